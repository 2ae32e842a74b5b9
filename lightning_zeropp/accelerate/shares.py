"""Each process's share of its pipeline's batch: the DDP view that metrics code expects.

Under DDP with `n` processes each process loads its own `b` rows, and loops written for it (HF's
run_clm) treat what a process holds as its rows: `gather_for_metrics(loss.repeat(b))` stands for
one value per sample, and the padded copies Accelerate adds to complete a short last batch are
dropped from the end of the gathered rows. Under `ZeroPPAccelerator` a data-parallel rank loads
the rows of its `pp_size` processes at once (every stage needs them all), so process
`(dp rank i, pipeline rank j)` is given the rows `[j*b, (j+1)*b)` of its rank's batch, which are
exactly the rows DDP's process `i*pp_size + j` would have loaded:

- in eval mode `outputs.loss` is the loss of those rows (`share_losses`), as under DDP;
- `gather` takes each process's share of a value that has one entry per row of the batch
  (`share`), or the whole value otherwise, and concatenates them in DDP's process order, so
  every sample appears once, from its owner, where DDP puts it, and Accelerate's truncation of
  the last batch drops the padded copies, as under DDP. Rows that do not split into the
  processes' shares (a packed row) are gathered once per pipeline (`owners_only`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "eval_microbatches_by_share",
    "share_of",
    "in_process_order",
    "owners_only",
    "process_order",
    "share",
    "share_losses",
]


def share_of(dims: Any) -> tuple[int, int]:
    """`(shares, index)`: how many processes read one data-parallel rank's batch (its pipeline's
    `pp_size`, times `cp_size` under context parallelism: every CP rank reads the whole rows)
    and this process's place among them (pipeline rank, then CP rank), as DDP numbers them."""
    cp = dims.config.cp_size
    return dims.config.pp_size * cp, dims.pp_rank * cp + dims.cp_rank


def process_order(pp_rank: int, dp_rank: int) -> list[int]:
    """Collective: every global rank, ordered as DDP numbers the processes whose rows the
    pipelines hold (data-parallel rank first, then pipeline rank)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (dp_rank, pp_rank))
    return sorted(range(len(everyone)), key=lambda rank: everyone[rank])


def share(value: Any, rows: int | None, pp_size: int, pp_rank: int) -> Any:
    """This process's rows of `value` when it has one entry per row of the batch (`rows`), or
    `value` itself (a per-process value, a scalar, or rows that do not split by `pp_size`)."""
    if rows is None or rows % pp_size:
        return value
    size = len(value) if isinstance(value, (list, tuple)) else _leading(value)
    if size != rows:
        return value
    per = rows // pp_size
    return value[pp_rank * per : (pp_rank + 1) * per]


def in_process_order(gathered: torch.Tensor, world: int, order: Sequence[int]) -> torch.Tensor:
    """`gathered` (equal chunks in global-rank order) with its chunks in DDP's process order."""
    if gathered.dim() == 0:
        return gathered
    size = gathered.shape[0] // world
    return torch.cat([gathered[r * size : (r + 1) * size] for r in order])


def owners_only(ordered: torch.Tensor, world: int, pp_size: int) -> torch.Tensor:
    """`ordered` (equal chunks in DDP's process order: data-parallel rank, then pipeline rank)
    with only each pipeline's first process's chunk: rows that do not split into shares are
    every process's of a pipeline, and each must appear once."""
    size = ordered.shape[0] // world
    return torch.cat([ordered[k * size : (k + 1) * size] for k in range(0, world, pp_size)])


def eval_microbatches_by_share(rows: int, num_microbatches: int, pp_size: int) -> int | None:
    """Micro-batches for a forward-only batch that never straddle two processes' shares: the
    most, up to `num_microbatches` (at least one per share), whose count is a multiple of
    `pp_size` and divides `rows`; None when the rows do not split into shares."""
    if rows % pp_size:
        return None
    per = rows // pp_size
    most = max(1, num_microbatches // pp_size)
    return pp_size * max(d for d in range(1, min(per, most) + 1) if per % d == 0)


def share_losses(
    losses: Sequence[torch.Tensor], pp_size: int, scale: float | None, tokens: torch.Tensor | None
) -> torch.Tensor:
    """Each share's loss (a `pp_size` vector) from the micro-batch losses of a batch, in order.

    `scale` and `tokens`: micro-batch losses are token sums divided by `scale` (`num_items_in_
    batch`), and `tokens` are each share's labelled tokens: a share's loss is its token mean.
    Otherwise each micro-batch loss is its mean, over equal micro-batches: a share's loss is the
    mean of its micro-batches' losses."""
    per = len(losses) // pp_size
    stacked = torch.stack([loss.detach().double() for loss in losses]).reshape(pp_size, per)
    if scale is None or tokens is None:
        return stacked.mean(dim=1).float()
    return (stacked.sum(dim=1) * scale / tokens.to(stacked)).float()


def _leading(value: Any) -> int | None:
    return value.shape[0] if isinstance(value, torch.Tensor) and value.dim() > 0 else None
