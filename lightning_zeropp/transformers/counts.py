"""The Trainer's counts over processes (tokens for the loss, tokens seen, flos), as one process
counts them: the processes of one pipeline hold the same rows, so sums run over data-parallel
ranks only, and a count that depends on padding is taken over the global batch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from lightning_zeropp.accelerate.steps import PipelineModel
from lightning_zeropp.models.packing import is_packed

__all__ = ["padded_tokens", "summing_over_data_parallel"]


@contextlib.contextmanager
def summing_over_data_parallel(accelerator: Any, pipeline: PipelineModel | None) -> Iterator[None]:
    """The Trainer sums per-process counts as `accelerator.gather(count).sum()`; the ranks
    of a pipeline hold the same rows, so the sum is taken over data-parallel ranks only."""
    if pipeline is None:
        yield
        return
    dims = pipeline.engine.dims

    def summed(value: torch.Tensor) -> torch.Tensor:
        total = value.detach().clone()
        for group in dims.dp_groups:
            dist.all_reduce(total, group=group)
        return total.reshape(1)

    accelerator.gather = summed  # shadows the method on this instance
    try:
        yield
    finally:
        del accelerator.gather


def padded_tokens(inputs: dict[str, Any], name: str, pipeline: PipelineModel | None) -> int | None:
    """Collective over data-parallel ranks: the tokens one process counts in this global batch
    padding included (`include_num_input_tokens_seen="all"`), or None where the Trainer's own
    count, summed over data-parallel ranks, is one process's already (no pipeline, packed rows,
    no rows of tokens).

    One process pads the global batch's rows to its longest; each data-parallel rank here padded
    its own rows (its pipeline's processes' rows) to theirs: so rows are summed over ranks and
    the length is the longest of them (a collator padding to a multiple pads the longest alike).
    Packed rows (one row of every document) have no padding: their sum is one process's."""
    ids = inputs.get(name)
    if pipeline is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    if is_packed(inputs):
        return None
    device = pipeline.engine.device
    rows = torch.tensor(ids.shape[0], dtype=torch.int64, device=device)
    length = torch.tensor(ids.shape[1], dtype=torch.int64, device=device)
    for group in pipeline.engine.dims.dp_groups:
        dist.all_reduce(rows, group=group)
        dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group)
    return int(rows * length)
