"""Gradient-norm clipping by the true global norm (every stage, every shard), and gradients
held out of `.grad` (a step's, for the front to scale; earlier ones, while a step runs)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_zeropp.core.shard.fsdp import local_shard

__all__ = ["StepGrads", "average_whole_grads", "clip_grad_norm_", "total_grad_norm"]


def total_grad_norm(
    params: Iterable[nn.Parameter], pp_group: dist.ProcessGroup | None, norm_type: float = 2.0
) -> torch.Tensor:
    """Norm of all gradients of the model: over this rank's shards, the dp mesh and all stages."""
    grads = [p.grad for p in params if p.grad is not None]
    # Sharded gradients and the few whole ones (parameters FSDP does not shard): one norm each,
    # the latter the same on every data-parallel rank, then combined.
    parts = []
    for kind in (DTensor, torch.Tensor):
        group = [g for g in grads if isinstance(g, DTensor) == (kind is DTensor)]
        if group:
            norm = torch.nn.utils.get_total_norm(group, norm_type=norm_type, foreach=False)
            if isinstance(norm, DTensor):  # partial over the shard axis: reduce it to the norm
                norm = norm.full_tensor()
            parts.append(norm.to(torch.float32))
    if not parts:  # a rank may hold no gradient at all (frozen stage): it still joins
        norm = torch.zeros((), dtype=torch.float32)
    elif len(parts) == 1:
        norm = parts[0]
    else:
        norm = torch.linalg.vector_norm(
            torch.stack([x.to(parts[0].device) for x in parts]), norm_type
        )
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        if norm_type == float("inf"):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            norm = norm.pow(norm_type)
            dist.all_reduce(norm, group=pp_group)
            norm = norm.pow(1.0 / norm_type)
    return norm


@torch.no_grad()
def average_whole_grads(
    params: Iterable[nn.Parameter], groups: list[dist.ProcessGroup], ranks: int
) -> None:
    """Average the gradients of the parameters FSDP left whole (not DTensors) over the
    data-parallel `groups` (`ranks` ranks in all), as FSDP averages the sharded ones. Every rank
    of a group holds the same stages, so the same such parameters: they cross as one vector, a
    gradient missing on a rank counting as zero, and one missing everywhere staying missing."""
    whole = [p for p in params if not isinstance(p, DTensor) and p.requires_grad]
    if not whole or not groups:
        return
    device = whole[0].device
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in whole]
    )
    present = torch.tensor([float(p.grad is not None) for p in whole], device=device)
    for group in groups:
        dist.all_reduce(flat, group=group)
        dist.all_reduce(present, group=group)
    flat /= ranks
    at = 0
    for p, seen in zip(whole, present.tolist(), strict=True):
        n = p.numel()
        if seen:
            p.grad = flat[at : at + n].view_as(p).to(p.dtype)
        at += n


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
        grad = with_grad[0].grad
        assert grad is not None  # kept above for having one
        device = grad.device
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
