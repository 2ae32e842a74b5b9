"""Whether the run the planner prices computes its head and loss in chunks, by the runtime's rule.

The engine computes a micro-batch's head and cross-entropy in chunks of `loss_chunk` tokens
(`core.step.chunked_loss`) where `chunk_for_run` gives a chunk (the call split, the engine's
default for a model without its own split, or one stage; no context parallelism) and the model's
loss is one the runtime chunks: the bundled GPT's `Head` (called with targets) and an HF causal
LM with HF's own forward, `ForCausalLMLoss` and a plain linear head (`fronts.hf_chunked`, as the
Accelerate front and `ZeroPPTrainer` install it). Where it does and a micro-batch holds more
tokens than a chunk, the last stage keeps the hidden states, not the fp32 logits
(`core.split.profile` runs the chunked loss itself on the meta device), and its backward
computes each chunk's logits again: one more head forward.

The planner cannot see a loss computed outside the model (a `loss_fn` over the logits, a
Lightning `training_step` over an HF model's `.logits`): those keep whole logits, and so does
`loss_chunk=0`, which prices them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.split.methods import resolve_split
from lightning_zeropp.core.split.profile import ModelProfile, micro_batch_rows, profile_model
from lightning_zeropp.core.step.chunked_loss import chunk_for_run
from lightning_zeropp.fronts.hf_chunked import ChunkedHead

__all__ = [
    "chunked_head",
    "chunked_profile",
    "head_recompute_flops",
    "loss_chunk_of",
    "priced_chunk",
    "with_whole_logits",
]


def chunked_head(model: nn.Module) -> str | None:
    """The module name of `model`'s head where the runtime computes its head and loss in chunks
    (the bundled GPT's `Head`, read by name as `fronts.hf_chunked` reads HF's loss; an eligible
    HF causal LM's output embedding), else None."""
    for name, module in model.named_modules():
        kind = type(module)
        if kind.__name__ == "Head" and kind.__module__ == "lightning_zeropp.models.gpt":
            return name
    found = ChunkedHead.eligible(model)
    if found is None:
        return None
    return next(name for name, module in model.named_modules() if module is found[1])


def loss_chunk_of(model: nn.Module, cfg: ZeroPPLayout) -> int:
    """Tokens per chunk of the head and the loss in the run of `cfg` (0: whole logits): the
    engine's `chunk_for_run` under its default split, for a model whose loss it chunks. An
    explicit `loss_chunk` where the run cannot chunk is refused, as the engine refuses it."""
    chunk = chunk_for_run(cfg.loss_chunk, resolve_split(model, "auto"), cfg.num_stages, cfg.cp_size)
    return chunk if chunked_head(model) is not None else 0


def priced_chunk(model: nn.Module, cfg: ZeroPPLayout, rows: int, seq_len: int) -> int:
    """`loss_chunk_of`, 0 where a micro-batch's tokens fit in one chunk (the runtime computes
    them as whole logits: `linear_cross_entropy`)."""
    chunk = loss_chunk_of(model, cfg)
    return chunk if 0 < chunk < rows * seq_len // cfg.cp_size else 0


def head_recompute_flops(model: nn.Module, rows: int, seq_len: int) -> float:
    """FLOPs the chunked loss's backward adds: each chunk's logits computed again (one forward
    of the head over the micro-batch's tokens, 2 x tokens x dim x vocabulary)."""
    name = chunked_head(model)
    if name is None:
        return 0.0
    weight = model.get_submodule(name).get_parameter("weight")
    return 2.0 * rows * seq_len * weight.numel()


def chunked_profile(
    model: nn.Module, profile: ModelProfile, rows: int, seq_len: int, dtype: torch.dtype | None
) -> ModelProfile:
    """`profile` (whole logits) with its last piece's saved bytes those of the chunked head and
    loss, counted by running it (`core.split.profile`); its FLOPs and output are unchanged
    (chunks change neither; the backward's extra head forward is `head_recompute_flops`)."""
    chunked = profile_model(model, rows, seq_len, dtype, chunked_head=chunked_head(model))
    saved = chunked.after.saved
    after = dataclasses.replace(profile.after, saved=saved, saved_recomputed=saved)
    return dataclasses.replace(profile, after=after)


def with_whole_logits(
    model: nn.Module,
    space: list[dict[str, Any]],
    world_size: int,
    global_batch: int,
    seq_len: int,
) -> list[dict[str, Any]]:
    """`space` with each layout whose run would compute its head and loss in chunks (`loss_chunk`
    unset) also priced with whole logits (`loss_chunk=0`): never slower, and much faster under
    a split backward, where the chunked loss's input task carries the head's weight gradient
    (`plan.stage_costs`); the search keeps it where its memory fits."""
    out = []
    for settings in space:
        out.append(settings)
        if settings.get("loss_chunk") is not None:
            continue
        cfg = ZeroPPConfig(**settings).resolve(world_size)
        rows = micro_batch_rows(global_batch, cfg.dp_size, cfg.num_microbatches)
        if priced_chunk(model, cfg, rows, seq_len) > 0:
            out.append({**settings, "loss_chunk": 0})
    return out
