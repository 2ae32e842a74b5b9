"""Small collectives the checkpoint code agrees with: a problem on any rank raised on every rank,
an object gathered from every rank, rank 0's string on every rank."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lightning_zeropp.core.step.failure import raised_everywhere

__all__ = ["all_gather", "broadcast_str", "raise_on_every_rank"]


def all_gather(value: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def raise_on_every_rank(problem: str | None) -> None:
    """Raise `ValueError` on every rank if any rank has a problem (a lone raise would hang)."""
    problems = [p for p in all_gather(problem) if p is not None]
    if problems:
        raise raised_everywhere(ValueError(problems[0]))


def broadcast_str(value: str) -> str:
    """Rank 0's string on every rank (temporary names must agree)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
