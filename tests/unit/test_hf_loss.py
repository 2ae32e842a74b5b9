"""How an HF model's loss counts tokens, read from the model itself (`fronts.hf_loss`), and the
Accelerate front's pieces that keep tied weights and eval shares exact, in one process."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_zeropp.accelerate.shares import (
    eval_microbatches_by_share,
    owners_only,
    share,
    share_losses,
)
from lightning_zeropp.accelerate.steps import PipelineOutput
from lightning_zeropp.fronts.hf_loss import NUM_ITEMS, TokenRule, token_rule
from lightning_zeropp.fronts.loss_rule import TokenCountAdapter
from lightning_zeropp.fronts.optim import optimizer_param_names, rebuild_optimizer
from tests.distributed.clm_loop import (
    Args,
    ManualLossLlama,
    OwnLossLlama,
    Texts,
    build_model,
    collate,
)


def _model(family: str, tied: bool = False) -> nn.Module:
    return build_model(Args(family=family, tie_word_embeddings=tied))


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "gemma2"])
def test_causal_lms_skip_the_first_label_whatever_their_class_is_called(family):
    model = _model(family)
    assert token_rule(model) == TokenRule(shift=1, pre_shift=0)
    if family == "gpt2":
        assert getattr(model, "loss_type", None) is None  # no name says "causal LM"


def test_other_losses_are_read_too_or_refused():
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoModelForSequenceClassification

    bert = AutoConfig.for_model(
        "bert", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32,
    )  # fmt: skip
    assert token_rule(AutoModelForMaskedLM.from_config(bert)) == TokenRule(shift=0)
    llama = _model("llama").config
    assert token_rule(AutoModelForSequenceClassification.from_config(llama)) is None
    assert token_rule(nn.Linear(2, 2)) is None  # no loss_function at all

    model = _model("llama")
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum() * 0 + 1.0
    assert token_rule(model) is None  # counts nothing a sum of token losses would
    mean = nn.functional.cross_entropy
    model.loss_function = lambda logits, labels, vocab_size, **kw: mean(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100
    )
    assert token_rule(model) is None  # ignores num_items_in_batch: a mean cannot be reweighted
    model.loss_function = lambda logits, labels, vocab_size, num_items_in_batch, **kw: (
        mean(
            logits[:, 2:].flatten(0, 1), labels[:, 2:].flatten(), ignore_index=-100, reduction="sum"
        )
        / num_items_in_batch
    )
    assert token_rule(model) == TokenRule(shift=2)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_micro_batch_losses_weighted_by_the_rule_are_the_models_own_loss(family):
    """What both fronts do with a padded batch, in one process: the model's loss on each
    micro-batch, given the batch's count, sums to the model's own loss on the batch."""
    model = _model(family, tied=True)
    batch = collate([Texts(8, 1)[i] for i in range(8)])
    want = model(**batch).loss
    rule = token_rule(model)
    assert rule is not None
    total = float(rule.counts(batch["labels"], 1).sum())
    parts = [{k: v[i : i + 2] for k, v in batch.items()} for i in range(0, 8, 2)]
    got = sum(model(**part, **{NUM_ITEMS: total}).loss for part in parts)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    counts = rule.counts(batch["labels"], 4)
    assert len(set(counts.tolist())) > 1  # the micro-batches really differ


def _bert() -> nn.Module:
    from transformers import AutoConfig, AutoModelForMaskedLM

    config = AutoConfig.for_model(
        "bert", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForMaskedLM.from_config(config)


@pytest.mark.parametrize("kind", ["llama", "own-loss", "bert", "manual-loss"])
def test_a_forward_computing_its_own_loss_is_weighed_exactly_or_refused(kind):
    """Micro-batch losses settled by `LossWatch` (as the fronts do, one micro-batch at a time)
    add up to the model's loss on the whole batch: the model's own loss_function given the count
    (llama), a mean cross-entropy rescaled (own-loss, BERT-MLM), or refused (a hand-made mean)."""
    llama = _model("llama")
    model = {
        "llama": llama,
        "own-loss": OwnLossLlama(llama.config),
        "bert": _bert(),
        "manual-loss": ManualLossLlama(llama.config),
    }[kind]
    batch = collate([Texts(8, 1)[i] for i in range(8)])
    if kind == "bert":  # a fixed mask: one token in three labelled
        keep = (batch["input_ids"] + torch.arange(batch["input_ids"].shape[1])) % 3 == 0
        batch["labels"] = batch["labels"].masked_fill(~keep, -100)
    want = model(**batch).loss
    adapter = TokenCountAdapter.for_model(model)
    assert adapter is not None
    adapter.microbatches = 4
    _, whole = adapter.stage_inputs((), dict(batch))
    parts = [{k: v[i : i + 2] for k, v in batch.items()} for i in range(0, 8, 2)]
    got = torch.zeros(())
    with adapter.counting():
        for part in parts:
            adapter._items = whole[NUM_ITEMS]  # the batch's count, as the front passes it
            output = model(**part, **{NUM_ITEMS: whole[NUM_ITEMS]})
            if kind == "manual-loss":
                with pytest.raises(ValueError, match="ManualLossLlama's forward did not compute"):
                    adapter.stage_output(output, (), part)
                return
            got = got + adapter.stage_output(output, (), part).loss.detach()
    torch.testing.assert_close(got / 4, want.detach(), rtol=0, atol=1e-6)
    means = sum(model(**part).loss.detach() for part in parts) / 4
    assert abs(float(means - want)) > 1e-4  # the mean of micro-batch means is not it


def test_a_tied_weight_is_in_the_rebuilt_optimizer_under_every_name():
    model = _model("llama", tied=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    names = optimizer_param_names(opt, model)[0]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    # a stage holding only the head still steps its copy; one holding both, one tensor once
    head = nn.Parameter(model.lm_head.weight.detach().clone())
    assert rebuild_optimizer(opt, [names], {"lm_head.weight": head}).param_groups[0]["params"] == [
        head
    ]
    whole = dict(model.named_parameters(remove_duplicate=False))
    rebuilt = rebuild_optimizer(opt, [names], whole).param_groups[0]["params"]
    assert len(rebuilt) == len(list(model.parameters()))


def test_outputs_of_a_training_call_say_how_to_get_logits():
    out = PipelineOutput(loss=torch.tensor(1.0))
    out._hint = "call the model in eval mode"
    with pytest.raises(AttributeError, match="logits: call the model in eval mode"):
        _ = out.logits


def test_shares_are_the_rows_ddp_processes_would_load():
    rows = torch.arange(8)
    assert share(rows, 8, 2, 1).tolist() == [4, 5, 6, 7]
    assert share(list(range(8)), 8, 2, 0) == [0, 1, 2, 3]
    assert share(rows[:2], 8, 2, 1).tolist() == [0, 1]  # a per-process value: whole
    assert share(torch.tensor(3.0), 8, 2, 1).item() == 3.0
    assert eval_microbatches_by_share(8, 8, 2) == 8 and eval_microbatches_by_share(6, 3, 2) == 2
    assert eval_microbatches_by_share(7, 4, 2) is None
    # a packed row per data-parallel rank, gathered from 4 processes (pp 2): each row once
    gathered = torch.tensor([[0], [0], [1], [1]])  # DDP order: (dp 0: pp 0, 1), (dp 1: pp 0, 1)
    assert owners_only(gathered, 4, 2).tolist() == [[0], [1]]
    # micro-batch token sums over num_items_in_batch 2.5: shares [3+1, 2+2] / tokens [4, 2]
    losses = [torch.tensor(v / 2.5) for v in (3.0, 1.0, 2.0, 2.0)]
    got = share_losses(losses, 2, 2.5, torch.tensor([4.0, 2.0]))
    torch.testing.assert_close(got, torch.tensor([1.0, 2.0]))
    assert share_losses(losses, 2, None, None).tolist() == pytest.approx([0.8, 0.8])
    empty = [torch.tensor(v / 2.5) for v in (0.0, 0.0, 2.0, 2.0)]  # a share without tokens
    assert math.isnan(share_losses(empty, 2, 2.5, torch.tensor([0.0, 2.0]))[0])  # as HF's mean
