"""The Trainer's counts over processes (tokens for the loss, tokens seen, flos), as one process
counts them: the processes of one pipeline hold the same rows, so sums run over data-parallel
ranks only, a count that depends on padding is taken over the global batch, and the rows
Accelerate repeats to complete a short last batch are not counted (`accelerate.repeats`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from lightning_zeropp.accelerate.repeats import without_repeated_rows
from lightning_zeropp.accelerate.steps import PipelineModel
from lightning_zeropp.fronts.packing import is_packed
from lightning_zeropp.transformers._private import (
    trainer_num_items_in_batch,
    trainer_track_num_input_tokens,
)

__all__ = [
    "items_in_window",
    "padded_tokens",
    "summed_over_data_parallel",
    "summing_over_data_parallel",
    "track_input_tokens",
    "without_repeats",
]


def items_in_window(
    trainer: Any, pipeline: PipelineModel | None, batch_samples: list, device: torch.device
) -> Any:
    """The Trainer's token count of the accumulation window, each row counted once, of the
    batches the pipeline trains on: its first stage's (a random collator draws on each
    rank), shared before the count and written into each rank's batch."""
    if pipeline is not None:
        shared = pipeline.engine.core.batches.share
        batch_samples[:] = [shared(batch) for batch in batch_samples]
    with summing_over_data_parallel(trainer.accelerator, pipeline):
        return trainer_num_items_in_batch(trainer, batch_samples, device)


def track_input_tokens(
    trainer: Any, pipeline: PipelineModel | None, inputs: dict[str, Any]
) -> None:
    """Tokens seen, as one process counts them (`padded_tokens`)."""
    name = getattr(trainer.model, "main_input_name", "input_ids")
    padded = trainer.args.include_num_input_tokens_seen == "all"
    seen = padded_tokens(inputs, name, pipeline) if padded else None
    if seen is None:
        with summing_over_data_parallel(trainer.accelerator, pipeline):
            trainer_track_num_input_tokens(trainer, inputs)
    else:
        trainer.state.num_input_tokens_seen += seen


@contextlib.contextmanager
def summing_over_data_parallel(accelerator: Any, pipeline: PipelineModel | None) -> Iterator[None]:
    """The Trainer sums per-process counts as `accelerator.gather(count).sum()`; the ranks
    of a pipeline hold the same rows, so the sum is taken over data-parallel ranks only."""
    if pipeline is None:
        yield
        return

    def summed(value: torch.Tensor) -> torch.Tensor:
        return summed_over_data_parallel(value, pipeline).reshape(1)

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


def summed_over_data_parallel(value: torch.Tensor, pipeline: PipelineModel) -> torch.Tensor:
    """Collective: `value` summed over the data-parallel ranks (a copy, detached)."""
    total = value.detach().clone()
    for group in pipeline.engine.dims.dp_groups:
        dist.all_reduce(total, group=group)
    return total


def without_repeats(
    inputs: dict[str, Any], state: Any, pipeline: PipelineModel
) -> dict[str, Any] | None:
    """The last packed evaluation batch with the labels of repeated documents masked (-100,
    `accelerate.repeats`); None for other batches. The same on every rank: the caller counts the
    tokens again, together."""
    last = is_packed(inputs) and state.end_of_dataloader and state.remainder > 0
    if not last:
        return None
    dims = pipeline.engine.dims
    return without_repeated_rows(inputs, state, dims.dp_rank, dims.dp_size)
