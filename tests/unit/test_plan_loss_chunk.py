"""The planner prices the head and the loss as the runtime computes them: in chunks
(`loss_chunk`) where the run chunks, the last stage then keeping the hidden states and not a
micro-batch's fp32 logits; whole logits where it does not (`loss_chunk=0`, a micro-batch within
one chunk, a split or context parallelism that computes whole logits, a model whose loss the
runtime does not chunk). FLOPs are unchanged; the backward adds one head forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_zeropp.core import ZeroPPConfig
from lightning_zeropp.core.split.methods import SPLIT_ATTR
from lightning_zeropp.models import GPT, GPTConfig
from lightning_zeropp.models.hf import build_causal_lm
from lightning_zeropp.plan import Hardware
from lightning_zeropp.plan.activations import stage_parts
from lightning_zeropp.plan.loss_chunk import chunked_head, loss_chunk_of
from lightning_zeropp.plan.simulate import _segment_seconds
from lightning_zeropp.plan.stage_costs import stage_costs

# A vocabulary large against the hidden size: the logits dwarf a block's activations.
BIG_HEAD = GPTConfig(vocab_size=1280, seq_len=64, dim=32, num_heads=2, num_layers=4)
ROWS, SEQ = 2, 64
LOGITS = ROWS * SEQ * BIG_HEAD.vocab_size * 4  # one micro-batch's fp32 logits


def _gpt() -> GPT:
    with torch.device("meta"):
        return GPT(BIG_HEAD)


def _llama(split: str | None = None) -> torch.nn.Module:
    with torch.device("meta"):
        model = build_causal_lm(
            "llama", vocab_size=1280, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
    if split is not None:  # as `split=` given to the engine: how "auto" resolves
        object.__setattr__(model, SPLIT_ATTR, split)
    return model


def _layout(**settings: object) -> object:
    return ZeroPPConfig(pp_size=2, num_microbatches=2, **settings).resolve(2)  # type: ignore[arg-type]


@pytest.mark.parametrize("model", [_gpt, lambda: _llama("call")], ids=["gpt", "hf_llama_call"])
def test_the_last_stage_keeps_the_hidden_states_not_the_logits(model) -> None:
    model = model()
    whole = stage_parts(model, _layout(loss_chunk=0), ROWS, SEQ)
    chunked = stage_parts(model, _layout(loss_chunk=16), ROWS, SEQ)
    assert chunked[0] == whole[0]  # the first stage: unchanged
    saved_less = whole[-1].saved - chunked[-1].saved
    # one micro-batch's fp32 logits (and the loss's scalar, a few bytes)
    assert LOGITS <= saved_less <= LOGITS + 64, (saved_less, LOGITS)
    assert chunked[-1].flops == whole[-1].flops  # chunks change no FLOPs
    assert chunked[-1].output == whole[-1].output


def test_whole_logits_where_the_run_computes_them() -> None:
    model = _gpt()
    whole = stage_parts(model, _layout(loss_chunk=0), ROWS, SEQ)
    # the default chunk (1024 tokens) holds the micro-batch's 128 tokens: whole logits
    assert stage_parts(model, _layout(), ROWS, SEQ) == whole
    assert stage_parts(model, _layout(loss_chunk=ROWS * SEQ), ROWS, SEQ) == whole
    # an HF model prepared by `models.hf` is traced at pp > 1: its loss reads whole logits
    traced = _llama()
    assert loss_chunk_of(traced, _layout()) == 0
    assert stage_parts(traced, _layout(), ROWS, SEQ) == stage_parts(
        traced, _layout(loss_chunk=0), ROWS, SEQ
    )


def test_a_chunk_the_run_would_refuse_is_refused() -> None:
    with pytest.raises(ValueError, match=r"loss_chunk=16 .* split='trace'"):
        stage_parts(_llama(), _layout(loss_chunk=16), ROWS, SEQ)
    cp = ZeroPPConfig(cp_size=2, loss_chunk=16).resolve(2)
    with pytest.raises(ValueError, match=r"loss_chunk=16 .*cp_size=2"):
        stage_parts(_gpt(), cp, ROWS, SEQ)


def test_soft_capped_logits_stay_whole() -> None:
    model = _llama("call")
    model.config.final_logit_softcapping = 30.0  # as Gemma-2: the runtime keeps whole logits
    assert chunked_head(model) is None
    assert loss_chunk_of(model, _layout(loss_chunk=16)) == 0
    assert chunked_head(_llama("call")) == "lm_head" and chunked_head(_gpt()) == "head"


def test_the_backward_computes_the_head_again() -> None:
    model = _gpt()
    hardware = Hardware(flops_per_s=1e12, intra_node_Bps=1e11, inter_node_Bps=1e10, node_size=2)
    cfg = _layout(loss_chunk=0)
    whole = stage_costs(model, cfg, 2 * ROWS, SEQ, hardware)[0]
    chunked = stage_costs(model, dataclasses.replace(cfg, loss_chunk=16), 2 * ROWS, SEQ, hardware)[
        0
    ]
    assert chunked[0] == whole[0]
    assert chunked[-1].forward == whole[-1].forward
    head = 2 * ROWS * SEQ * BIG_HEAD.dim * BIG_HEAD.vocab_size / 1e12
    assert chunked[-1].backward[0] == pytest.approx(whole[-1].backward[0] + head, rel=1e-9)
    assert chunked[-1].backward[1:] == whole[-1].backward[1:]
    # its input pass computes the head's weight gradient too: the head unit has no W share
    assert chunked[-1].weight_share == (0.0, *[0.5] * (len(chunked[-1].backward) - 1))
    assert whole[-1].weight_share == 0.5
    head_i = _segment_seconds(chunked[-1], "I")[-1]  # (the backward visits units last to first)
    assert head_i == pytest.approx(chunked[-1].backward[0] + chunked[-1].overhead, rel=1e-9)
    assert _segment_seconds(chunked[-1], "W")[-1] == 0.0
    assert _segment_seconds(whole[-1], "W")[-1] == pytest.approx(whole[-1].backward[0] / 2)


def test_the_search_takes_whole_logits_where_they_fit_and_chunks_where_they_do_not() -> None:
    """Every enumerated layout whose run would chunk is priced with whole logits too: never
    slower (one head forward less; under a split backward no head weight gradient in the input
    task), so where memory allows the search's fastest layout keeps whole logits, and where only
    the chunked loss fits it chunks."""
    from lightning_zeropp.plan.loss_chunk import with_whole_logits
    from lightning_zeropp.plan.peaks import rank_memory
    from lightning_zeropp.plan.search import search

    seq = 1024  # 2 rows a micro-batch: more tokens than the default chunk (1024)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=1280, seq_len=seq, dim=16, num_heads=2, num_layers=4))
    world, batch = 2, 4
    space = [{"pp_size": 2, "num_microbatches": 2, "schedule": "zeropp", "node_size": 2}]
    expanded = with_whole_logits(model, space, world, batch, seq)
    assert expanded == [space[0], {**space[0], "loss_chunk": 0}]
    assert with_whole_logits(model, [{**space[0], "loss_chunk": 16}], world, batch, seq) == [
        {**space[0], "loss_chunk": 16}
    ]
    one_chunk = [{**space[0], "num_microbatches": 4}]  # 1 row: 1024 tokens, one chunk: whole
    assert with_whole_logits(model, one_chunk, world, batch, seq) == one_chunk
    hardware = Hardware(flops_per_s=1e12, intra_node_Bps=1e11, inter_node_Bps=1e10, node_size=2)
    free = search(model, world, batch, seq, hardware, top=200)
    whole = {
        tuple(sorted((k, str(v)) for k, v in c.settings.items() if k != "loss_chunk")): c
        for c in free
        if c.settings.get("loss_chunk") == 0
    }
    assert whole, "layouts that chunk are priced with whole logits too"
    chunked, twin = next(
        (c, whole[key])
        for c in free
        if c.settings.get("loss_chunk") is None
        and (key := tuple(sorted((k, str(v)) for k, v in c.settings.items()))) in whole
    )
    assert twin.step_s <= chunked.step_s
    assert free.index(twin) < free.index(chunked)
    assert twin.memory_bytes > chunked.memory_bytes
    # a budget the chunked layout fits and its whole-logits twin does not
    budget = dataclasses.replace(
        hardware, memory_bytes=(twin.memory_bytes + chunked.memory_bytes) // 2
    )
    tight = search(model, world, batch, seq, budget, top=50, per_rank=False)
    settings = [c.settings for c in tight]
    assert chunked.settings in settings and twin.settings not in settings
    assert (
        max(
            r["total"]
            for r in rank_memory(model, ZeroPPConfig(**chunked.settings), world, batch, seq)
        )
        == chunked.memory_bytes
    )
