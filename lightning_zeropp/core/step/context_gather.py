"""Context parallelism's gathers along the sequence: a tensor of this CP rank's part of every
sequence put together with the other CP ranks' in global order (`gather_sequence`, differentiable:
the backward reduce-scatters), and a network's output made whole sequences on every CP rank
(`whole_sequences`), for a loss the front runs on the last stage. The attention gathers its keys
and values with the same function (`core.step.context_attention`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_zeropp.core._torch_private import tree_map
from lightning_zeropp.core.step.context import ContextSplit
from lightning_zeropp.core.step.context_blocks import gather_rows, scatter_rows

__all__ = ["gather_sequence", "whole_sequences"]


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim -2 over the CP group, rows put in global order; backward: the
    gradient's rows back in gathered order, reduce-scattered (summed: each rank's keys serve
    every rank's queries)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor
    ) -> torch.Tensor:
        ctx.group, ctx.order = group, order
        return gather_rows(x, group, order)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return scatter_rows(grad, ctx.group, ctx.order), None, None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor) -> torch.Tensor:
    """Every CP rank's `x` along dim -2 in global sequence order (differentiable)."""
    return _GatherSequence.apply(x, group, order.to(x.device))


def whole_sequences(output: Any, split: ContextSplit, group: dist.ProcessGroup) -> Any:
    """`output` with every per-token tensor, (batch, this rank's tokens, features...), gathered
    over the CP group into whole sequences, in order (differentiable). A loss the front then
    computes from it is the same on every CP rank, and the backward's reduce-scatter sums the
    CP ranks' equal gradients, which the engine's mean over CP ranks divides back: one
    process's gradient.

    Per-token means three or more dimensions with dim 1 this rank's token count (logits, hidden
    states). A 2-D tensor whose dim 1 equals that count is refused: (batch, tokens) and
    (batch, classes) look alike there, and gathering one of them would be wrong. Any other
    tensor of one dimension or more is refused too: computed inside the forward from this
    rank's part of each sequence (a pooled head, a row's score), it differs on every CP rank.
    Scalars pass (a loss over this rank's tokens is one the engine's mean over CP ranks takes)."""
    local = split.local_length

    def whole(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        if value.dim() < 2 or value.shape[1] != local:
            raise ValueError(
                "under context parallelism (cp_size > 1) the network returned a tensor of "
                f"shape {tuple(value.shape)} with no sequence dimension of this rank's {local} "
                f"of the {split.length} tokens at dim 1: a value per row computed inside the "
                "forward (a pooled head, a row's score) sees one CP rank's part of each "
                "sequence only, and would differ on every CP rank. Return per-token outputs "
                "(batch, tokens, ...) and pool them in the step, or set cp_size=1."
            )
        if value.dim() == 2:  # (batch, this rank's tokens) or (batch, as many classes)
            raise ValueError(
                "under context parallelism (cp_size > 1) the network returned a 2-D tensor of "
                f"shape {tuple(value.shape)} whose dim 1 equals this rank's {local} of the "
                f"{split.length} tokens: the library cannot tell per-token values (batch, "
                "tokens) from per-row features (batch, classes). Return per-token values with "
                "a trailing feature dimension, (batch, tokens, 1), or set cp_size=1."
            )
        # (batch, this rank's tokens, features...); contiguous, as a model's own output is
        # (losses `.view` their logits)
        moved = value.movedim(1, -2)
        return gather_sequence(moved, group, split.order).movedim(-2, 1).contiguous()

    return tree_map(whole, output)
