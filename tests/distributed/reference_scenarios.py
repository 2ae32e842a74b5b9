"""A DPO reference model that fits one pipeline rank's stages and not another's."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_zeropp.trl.reference import FrozenReference


def mismatch_on_rank_1() -> str:
    """Rank 1's stage holds a parameter the reference has in another shape; rank 0's fits.
    Returns what this rank raised (every rank must refuse)."""
    rank = dist.get_rank()
    param = nn.Parameter(torch.zeros(4, 3 if rank == 1 else 2))
    state = {f"layers.{rank}.weight": torch.zeros(4, 2)}
    try:
        FrozenReference([(f"layers.{rank}.weight", param)], state)
    except ValueError as err:
        return str(err)
    return "no error"
