"""The samples Accelerate repeats to complete a short last evaluation batch, kept out of a loss
computed over the global batch: how many of a data-parallel rank's samples are repeats
(`accelerate.repeats.repeated_samples`), rows and packed documents masked (`without_repeated_rows`), and
TRL's pairwise losses (`reward_loss`, `dpo_loss`) equal to the same loss over the real pairs only.
The distributed cases (`test_last_loss`, `test_trl*` at dp 2) compare whole runs with one
process; these check the pieces on one rank, in CI."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_zeropp.accelerate.repeats import repeated_samples, without_repeated_rows


def _state(last: bool, remainder: int, total: int = 8) -> SimpleNamespace:
    """A loader's `GradientState`: `total` samples a global batch (2 data-parallel ranks of 4)."""
    loader = SimpleNamespace(total_batch_size=total)
    return SimpleNamespace(end_of_dataloader=last, remainder=remainder, active_dataloader=loader)


@pytest.mark.parametrize(
    ("dp_rank", "dp_size", "last", "remainder", "want"),
    [
        (0, 2, False, 7, 0),  # not the last batch: nothing repeated
        (1, 2, True, 0, 0),  # a last batch that divides: nothing repeated
        (0, 2, True, 7, 0),  # 7 samples, 4 a rank: rank 0 holds 0..3
        (1, 2, True, 7, 1),  # rank 1 holds 4..6 and one repeat
        (1, 2, True, 3, 4),  # rank 1 holds repeats only
        (0, 1, True, 3, 0),  # one data-parallel rank: a short batch, nothing repeated
    ],
)
def test_repeated_samples(dp_rank, dp_size, last, remainder, want):
    total = 4 * dp_size
    assert repeated_samples(_state(last, remainder, total), dp_rank, dp_size, 4) == want
    if dp_size > 1 and want:  # without even_batches the last batch holds the real ones only
        assert repeated_samples(_state(last, remainder, total), dp_rank, dp_size, 4 - want) == 0


def test_repeated_rows_are_masked():
    labels = torch.arange(12).view(4, 3)
    inputs = {"input_ids": labels.clone(), "labels": labels}
    out = without_repeated_rows(inputs, _state(True, 6), 1, 2)
    assert torch.equal(out["labels"][:2], labels[:2])
    assert bool((out["labels"][2:] == -100).all())
    assert torch.equal(inputs["labels"], torch.arange(12).view(4, 3))  # the batch given: kept
    assert without_repeated_rows(inputs, _state(False, 6), 1, 2) is inputs
    assert without_repeated_rows(inputs, _state(True, 6), 0, 2) is inputs


def test_repeated_packed_documents_are_masked():
    # one row of four documents (one a sample): rank 1 of 2, 7 samples, so its last is repeated
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 0, 1]])
    labels = torch.arange(10).view(1, 10)
    inputs = {"input_ids": labels.clone(), "position_ids": positions, "labels": labels}
    out = without_repeated_rows(inputs, _state(True, 7), 1, 2)
    assert out["labels"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, -100, -100]]


def test_repeats_that_cannot_be_told_apart_are_refused():
    # packed samples of several documents each (TRL's packing): 6 documents for 4 samples
    positions = torch.tensor([[0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1]])
    packed = {"position_ids": positions, "labels": torch.arange(12).view(1, 12)}
    with pytest.raises(ValueError, match="holds 4 samples, 1 of them repeated by Accelerate"):
        without_repeated_rows(packed, _state(True, 7), 1, 2)
    # at one data-parallel rank nothing is repeated: the short batch is the dataset's own
    assert without_repeated_rows(packed, _state(True, 3, 4), 0, 1) is packed
    floats = {"labels": torch.rand(4, 3)}
    with pytest.raises(ValueError, match="floating-point labels, which cannot be masked"):
        without_repeated_rows(floats, _state(True, 7), 1, 2)
    two_rows = {"labels": torch.ones(8, dtype=torch.long)}  # two rows a sample
    with pytest.raises(ValueError, match="8 rows, which are not one per sample"):
        without_repeated_rows(two_rows, _state(True, 7), 1, 2)


def test_the_causal_lm_test_reads_the_class_fsdp_made_its_own_from():
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoConfig, LlamaForCausalLM

    from lightning_zeropp.transformers.losses import causal_lm

    config = AutoConfig.for_model(
        "llama", hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=16,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    assert causal_lm(model)
    model.__class__ = type("FSDPLlamaForCausalLM", (FSDPModule, LlamaForCausalLM), {})
    assert causal_lm(model)  # what fully_shard makes of it
    model.__class__ = type("MyLM", (LlamaForCausalLM,), {})
    assert not causal_lm(model)  # a user's subclass: the Trainer's own test says no


def _rewards(values: list[float]) -> dict[str, torch.Tensor]:
    return {"logits": torch.tensor(values).unsqueeze(-1)}


def test_the_reward_loss_counts_only_the_real_pairs():
    pytest.importorskip("trl")
    from lightning_zeropp.trl.reward import reward_loss

    # 3 pairs in pair order (chosen rows, then rejected), the third a repeat
    output = _rewards([0.5, -0.2, -9.0, 0.1, 0.3, 9.0])
    labels = torch.tensor([1, 1, -100, 1, 1, -100])
    margin = torch.tensor([0.2, -0.1, 5.0])
    loss, metrics = reward_loss(output, labels, 4.0, center=0.1, margin=margin)
    real_loss, real = reward_loss(
        _rewards([0.5, -0.2, 0.1, 0.3]), torch.ones(4, dtype=torch.long), 4.0, 0.1, margin[:2]
    )
    torch.testing.assert_close(loss, real_loss)
    for name, value in real.items():
        torch.testing.assert_close(metrics[name], value, msg=name)
    assert float(metrics["max_reward"]) == pytest.approx(0.5)  # not the repeat's 9.0


def test_the_dpo_loss_counts_only_the_real_pairs():
    pytest.importorskip("trl")
    from lightning_zeropp.trl.dpo import dpo_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, 7, generator=g)  # rows c0 r0 c1 r1 c2 r2, the third pair repeated
    labels = torch.randint(0, 7, (6, 5), generator=g)
    completion = torch.tensor([[0, 0, 1, 1, 1]] * 6)
    ref = torch.randn(6, generator=g)
    counted = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    loss, metrics = dpo_loss(
        {"logits": logits}, labels, 2.0, completion, ref, beta=0.1, counted=counted
    )
    want, real = dpo_loss({"logits": logits[:4]}, labels[:4], 2.0, completion[:4], ref[:4], 0.1)
    torch.testing.assert_close(loss, want)
    for name, value in real.items():
        torch.testing.assert_close(metrics[name], value, msg=name)
