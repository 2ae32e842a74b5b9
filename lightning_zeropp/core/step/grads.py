"""Gradient-norm clipping by the true global norm (every stage, every shard), and gradients
held out of `.grad` (a step's, for the front to scale; earlier ones, while a step runs)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_zeropp.core.shard.fsdp import local_shard

__all__ = ["StepGrads", "clip_grad_norm_", "total_grad_norm"]


def total_grad_norm(
    params: Iterable[nn.Parameter], pp_group: dist.ProcessGroup | None, norm_type: float = 2.0
) -> torch.Tensor:
    """Norm of all gradients of the model: over this rank's shards, the dp mesh and all stages."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=False)
        if isinstance(norm, DTensor):  # partial over the shard axis: reduce it to the true norm
            norm = norm.full_tensor()
    else:  # a rank may hold no gradient at all (frozen stage): it still joins the reduction
        norm = torch.zeros((), dtype=torch.float32)
    norm = norm.to(torch.float32)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        if norm_type == float("inf"):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            norm = norm.pow(norm_type)
            dist.all_reduce(norm, group=pp_group)
            norm = norm.pow(1.0 / norm_type)
    return norm


def clip_grad_norm_(
    params: Iterable[nn.Parameter],
    max_norm: float,
    pp_group: dist.ProcessGroup | None,
    norm_type: float = 2.0,
    counted: Iterable[nn.Parameter] | None = None,
) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm`; return the norm before.

    `counted`: the parameters the norm sums over, when not all of `params` (copies of a tied
    weight hold one gradient, counted once).
    """
    params = list(params)
    norm = total_grad_norm(params if counted is None else counted, pp_group, norm_type)
    with_grad = [p for p in params if p.grad is not None]
    if with_grad:
        device = with_grad[0].grad.device
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, norm.to(device), foreach=False)
    return norm


class StepGrads:
    """Gradients taken out of `.grad` and added back later: one training step's, kept until the
    front says what they are worth (the one place the fronts' gradient scaling happens), or
    earlier steps' ones, kept out of the way while a step runs (the pipeline runtime divides
    every gradient present by the micro-batch count).

    `apply(scale)` adds them to `.grad` times `scale` (1/k for an accumulation of k batches, the
    gradient a loop's backward brings to the loss, ...; a tensor scale stays on the device, so
    applying costs no host sync); `discard()` drops them (a skipped step).
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        """Take the gradients present now out of `params`' `.grad`."""
        self._pending: list[tuple[nn.Parameter, torch.Tensor]] = []
        for p in params:
            if p.grad is not None:
                self._pending.append((p, p.grad))
                p.grad = None

    @torch.no_grad()
    def apply(self, scale: float | torch.Tensor = 1.0) -> None:
        for p, g in self._pending:
            if isinstance(scale, torch.Tensor) or scale != 1.0:
                local = local_shard(g)
                local.mul_(scale.to(local.dtype) if isinstance(scale, torch.Tensor) else scale)
            p.grad = g if p.grad is None else p.grad + g
        self._pending.clear()

    def discard(self) -> None:
        self._pending.clear()
