"""One micro-batch of a model, measured on the meta device block by block: what each block saves
for backward (as it runs, and as it runs recomputed), its forward FLOPs and the size of its output,
and the same for the work before the first block (embeddings) and after the last (norm, head,
loss).

The whole model runs once (shapes only, no compute), with hooks around each block attributing
what happens inside it (`core.split.profile_run`, re-exported here: `meta_forward`); stages cut at block boundaries, so a stage's figures are sums of its
blocks', plus the work before the blocks on the first stage and after them on the last. This needs
no stage modules that run on their own, so any model with a block list works: the bundled GPT,
HF `*ForCausalLM` (which the engine cuts with split="call"), litgpt.

Saved bytes count each storage once, weights excluded, attention as fused kernels save it
(`meta_forward`). With `chunked_head` the head and the loss run as the runtime's chunked loss
(`core.step.chunked_loss.linear_cross_entropy`, run itself on the meta device): what it saves is
counted, the hidden states and the targets, not a micro-batch's fp32 logits. A recomputed block saves what torch's non-reentrant checkpoint keeps (its
inputs), counted by wrapping the blocks as the engine does (`core.shard.fsdp`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zeropp.core.shard.fsdp import apply_activation_checkpointing
from lightning_zeropp.core.split.blocks import find_blocks
from lightning_zeropp.core.split.profile_run import Tally, meta_forward, run_tallied
from lightning_zeropp.core.split.repeats import repeats_skipped
from lightning_zeropp.core.step.chunked_loss import linear_cross_entropy

__all__ = [
    "ModelProfile",
    "Part",
    "lm_loss",
    "meta_forward",
    "micro_batch_rows",
    "profile_copy",
    "profile_model",
]


def micro_batch_rows(global_batch: int, dp_size: int, num_microbatches: int) -> int:
    """Rows of one micro-batch; a global batch the layout cannot split evenly is refused (a
    prediction for a batch that would not run is no prediction)."""
    if global_batch < 1 or global_batch % (dp_size * num_microbatches):
        raise ValueError(
            f"global_batch={global_batch} does not split into {dp_size} data-parallel ranks x "
            f"{num_microbatches} micro-batches; use a multiple of {dp_size * num_microbatches}."
        )
    return global_batch // (dp_size * num_microbatches)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy, the loss the planner assumes (computed in fp32)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


@dataclass(frozen=True)
class Part:
    """One piece of a micro-batch's forward."""

    saved: int  # bytes saved for backward
    saved_recomputed: int  # ... when the piece is a checkpointed block (its inputs)
    flops: float  # forward FLOPs (backward: twice these)
    output: int  # bytes of what it returns (what crosses to the next stage after it)


@dataclass(frozen=True)
class ModelProfile:
    before: Part  # embeddings and whatever runs before the first block
    blocks: list[Part]
    after: Part  # final norm, head and loss

    def stage(self, blocks: range, first: bool, last: bool, recompute: bool) -> Part:
        """A stage holding `blocks` (and the parts before and after them when first / last)."""
        parts = [*([self.before] if first else []), *[self.blocks[i] for i in blocks]]
        parts += [self.after] if last else []
        chosen = [self.blocks[i] for i in blocks]
        saved = sum(p.saved_recomputed if recompute else p.saved for p in chosen)
        saved += (self.before.saved if first else 0) + (self.after.saved if last else 0)
        return Part(
            saved=saved,
            saved_recomputed=saved,
            flops=sum(p.flops for p in parts),
            output=parts[-1].output,
        )


@functools.lru_cache(maxsize=256)  # a search prices every micro-batch size many times
def profile_model(
    model: nn.Module,
    rows: int,
    seq_len: int,
    dtype: torch.dtype | None = None,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = lm_loss,
    chunked_head: str | None = None,
) -> ModelProfile:
    """Profile one micro-batch of `rows` x `seq_len` token ids through `model` (meta device),
    computed in `dtype` when given (mixed precision); `chunked_head` (the output head's module
    name) computes the head and the loss in chunks, as the runtime does where it chunks.

    Every figure is affine in the rows (per-row tensors, plus a few that do not depend on them,
    such as rotary tables), so the model runs at 1 and 2 rows and the rest is extrapolated; a
    search then prices every micro-batch size from two runs."""
    one, two = _profile(model, seq_len, dtype, loss_fn, chunked_head)
    if rows in (1, 2):
        return one if rows == 1 else two

    def at(a: Part, b: Part) -> Part:
        return Part(
            *(
                x + (y - x) * (rows - 1)
                for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b), strict=True)
            )
        )

    return ModelProfile(
        before=at(one.before, two.before),
        blocks=[at(a, b) for a, b in zip(one.blocks, two.blocks, strict=True)],
        after=at(one.after, two.after),
    )


@functools.lru_cache(maxsize=32)  # a search prices many layouts of one model
def _profile(
    model: nn.Module,
    seq_len: int,
    dtype: torch.dtype | None,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    chunked_head: str | None = None,
) -> tuple[ModelProfile, ModelProfile]:
    """The profiles of one and of two rows (one copy of the model for both)."""
    model = copy.deepcopy(model)
    if dtype is not None:
        model = model.to(dtype)
    if chunked_head is not None:
        loss_fn = _chunked_loss(model.get_submodule(chunked_head), seq_len)
    container, names = find_blocks(model)
    holder = model.get_submodule(container) if container else model
    blocks = [holder.get_submodule(n) for n in names]
    with repeats_skipped(blocks) as repeats:
        plain = [run_tallied(model, blocks, rows, seq_len, loss_fn, repeats) for rows in (1, 2)]
        apply_activation_checkpointing(holder, names)
        # recomputed, only what is saved counts: the FLOPs are the plain run's
        recomputed = [
            run_tallied(model, blocks, rows, seq_len, loss_fn, repeats, count_flops=False)
            for rows in (1, 2)
        ]
    return _assemble(plain[0], recomputed[0]), _assemble(plain[1], recomputed[1])


def _chunked_loss(head: nn.Module, seq_len: int) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The loss of a copy whose `head` now returns its input: the runtime's chunked head and
    loss over those hidden states. Chunks of half a row, so that even one row runs the chunked
    node (what it saves, the hidden states, does not depend on the chunk; its FLOPs are the
    whole head's either way); the planner asks for it only where the run's chunk is smaller
    than a micro-batch's tokens (a chunk holding them all computes whole logits)."""
    weight, bias = head.get_parameter("weight"), getattr(head, "bias", None)
    head.forward = lambda hidden, *args, **kwargs: hidden  # type: ignore[method-assign]

    def loss(hidden: Any, target: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, bias, target, chunk=max(1, seq_len // 2))

    return loss


def profile_copy(model: nn.Module, seq_len: int) -> ModelProfile:
    """One row of `seq_len` token ids through `model` itself, a meta-device copy the caller owns
    (the engine's, thrown away after): not cached, not copied again, and without the recomputed
    run (`saved_recomputed` is `saved`: the cut prices time, not recomputation)."""
    container, names = find_blocks(model)
    holder = model.get_submodule(container) if container else model
    blocks = [holder.get_submodule(n) for n in names]
    with repeats_skipped(blocks) as repeats:
        plain = run_tallied(model, blocks, 1, seq_len, lm_loss, repeats)
    return _assemble(plain, plain)


def _assemble(plain: Tally, recomputed: Tally) -> ModelProfile:
    parts = [
        Part(saved=s, saved_recomputed=r, flops=f, output=o)
        for s, r, f, o in zip(
            plain.saved[1:-1], recomputed.saved[1:-1], plain.flops[1:-1], plain.output[1:-1],
            strict=True,
        )
    ]  # fmt: skip
    return ModelProfile(
        before=Part(plain.saved[0], plain.saved[0], plain.flops[0], plain.output[0]),
        blocks=parts,
        after=Part(plain.saved[-1], plain.saved[-1], plain.flops[-1], plain.output[-1]),
    )
