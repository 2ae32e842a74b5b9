"""What the fronts refuse and compute under context parallelism (cp_size > 1), in one process:
a Lightning network's own loss refused, the Accelerate front's refusals, its target shifted on the
whole sequence, and each process's share of a data-parallel rank's rows (pp x cp processes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_zeropp.accelerate.shares import share_of
from lightning_zeropp.accelerate.steps import PipelineModel
from lightning_zeropp.core.step.last_loss import LastLossStep, LastStageLoss
from lightning_zeropp.fronts.hf_loss import TokenRule
from lightning_zeropp.lightning.steps import _check_not_a_loss
from lightning_zeropp.lightning.weighting import GlobalTokenCount


def test_a_lightning_network_computing_its_own_loss_is_refused_under_cp():
    with pytest.raises(ValueError, match="the network returned a scalar"):
        _check_not_a_loss(torch.tensor(1.0))
    _check_not_a_loss(torch.zeros(2, 4, 8))  # logits: gathered, the step computes the loss


def test_a_lightning_step_giving_its_own_token_count_is_refused_under_cp():
    """Under CP the labels stay out of the stages and the library runs the model's loss on the
    whole sequences with the global count; a count the step passes would have left the output
    without a loss (found in review): refused instead."""
    labels = torch.tensor([[1, 2, -100]])
    adapter = GlobalTokenCount(TokenRule(1), None, lambda t: t, 1, context=True)
    with pytest.raises(ValueError, match="num_items_in_batch= to the HF model; pass labels"):
        adapter.stage_inputs((), {"labels": labels, "num_items_in_batch": 2})
    _, kwargs = adapter.stage_inputs((), {"labels": labels})
    assert "labels" not in kwargs and "num_items_in_batch" not in kwargs
    plain = GlobalTokenCount(TokenRule(1), None, lambda t: t, 1, context=False)
    assert (
        plain.stage_inputs((), {"labels": labels, "num_items_in_batch": 2})[1]["labels"] is labels
    )


def _pipeline(cp: int, last_loss: object = None, rule: TokenRule | None = None) -> object:
    engine = SimpleNamespace(config=SimpleNamespace(cp_size=cp))
    return SimpleNamespace(
        engine=engine, last_loss=last_loss, rule=rule, original=torch.nn.Linear(1, 1)
    )


def test_the_accelerate_front_refuses_what_it_cannot_weigh_under_cp():
    causal = TokenRule(shift=1, pre_shift=0)
    PipelineModel._check_context(_pipeline(1, last_loss=object()))  # no CP: anything goes
    PipelineModel._check_context(_pipeline(2, rule=causal))  # an HF causal LM's loss
    # a last-stage loss runs on whole sequences, whatever the model's own loss takes
    PipelineModel._check_context(_pipeline(2, last_loss=LastStageLoss(len), rule=None))
    pairs = LastStageLoss(len, shift=1, group=2)  # DPO's, the reward trainer's
    # pairs of rows: CP splits the sequence, not the rows (DPO on a causal LM runs)
    PipelineModel._check_context(_pipeline(2, last_loss=pairs, rule=causal))
    with pytest.raises(ValueError, match="its loss must take num_items_in_batch and shift_labels"):
        PipelineModel._check_context(_pipeline(2, rule=TokenRule(shift=1, pre_shift=None)))
    with pytest.raises(ValueError, match="Linear cannot run under context parallelism"):
        PipelineModel._check_context(_pipeline(2, rule=None))


def test_the_accelerate_target_is_shifted_on_the_whole_sequence_under_cp():
    labels = torch.tensor([[5, 6, 7, -100]])
    assert PipelineModel._context_target(_pipeline(1), labels) is labels
    shifted = PipelineModel._context_target(_pipeline(2), labels)
    assert shifted.tolist() == [[6, 7, -100, -100]]


@pytest.mark.parametrize(
    ("pp", "cp", "pp_rank", "cp_rank", "want"),
    [(2, 1, 1, 0, (2, 1)), (2, 2, 0, 1, (4, 1)), (2, 2, 1, 0, (4, 2)), (1, 2, 0, 1, (2, 1))],
)
def test_each_process_of_a_data_parallel_rank_has_its_share(pp, cp, pp_rank, cp_rank, want):
    dims = SimpleNamespace(
        config=SimpleNamespace(pp_size=pp, cp_size=cp), pp_rank=pp_rank, cp_rank=cp_rank
    )
    assert share_of(dims) == want


def test_a_last_stage_loss_under_cp_sees_the_whole_unshifted_labels():
    """Under CP the schedule hands the loss this CP rank's part of the labels, shifted; the
    loss is given the micro-batch's whole labels as one process gives them."""
    labels = torch.arange(16).reshape(4, 4)
    seen = []
    loss = LastStageLoss(lambda out, y, num_items_in_batch: seen.append(y) or out.sum())
    step = LastLossStep(loss, 1.0, 2, labels, whole=True)
    local = labels[:, 1:3]  # a CP rank's part: other columns, the same rows
    step(torch.ones(2, 4, 3), local[:2])
    step(torch.ones(2, 4, 3), local[2:])
    assert [y.tolist() for y in seen] == [labels[:2].tolist(), labels[2:].tolist()]
    with pytest.raises(RuntimeError, match="got labels of 3 rows, micro-batch 0 has 2"):
        step(torch.ones(3, 4, 3), labels[:3])


def test_the_shape_probe_of_a_last_stage_loss_under_cp_is_a_zero_through_the_output():
    """torch's shape-inference call hands the loss this CP rank's part of the output, which a
    per-token row of the whole sequence (DPO's completion mask, 8 tokens) does not fit: the
    probe is a zero the backward runs through, and the loss is not called."""
    labels = torch.zeros(4, 8, dtype=torch.long)
    mask = torch.ones(4, 8)

    def needs_whole(out, y, num_items_in_batch, completion_mask):
        return (out[..., 0] * completion_mask[: out.shape[0]]).sum()

    loss = LastStageLoss(needs_whole, rows=("completion_mask",))
    part = torch.ones(2, 4, 3, requires_grad=True)  # 4 of the 8 tokens
    with pytest.raises(RuntimeError):  # what the loss itself does with a CP rank's part
        LastLossStep(loss, 1.0, 2, labels, {"completion_mask": mask}).probe(part, labels[:2, :4])
    step = LastLossStep(loss, 1.0, 2, labels, {"completion_mask": mask}, whole=True)
    probe = step.probe(part, labels[:2, :4])
    assert probe.item() == 0.0
    probe.backward()
    assert torch.equal(part.grad, torch.zeros_like(part))
    assert step.metrics == [] and step._calls == 0  # no micro-batch counted
