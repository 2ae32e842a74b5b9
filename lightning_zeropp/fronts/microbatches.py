"""How many micro-batches a front's call runs in, and whether a loader's rows split into them: the
decisions each front makes before it hands a batch to the engine, in one place.

- `call_microbatches`: in training the configured `num_microbatches`; forward only (validation,
  evaluation, prediction), the most up to it that split the rows equally (a short last batch of 7
  rows runs as one: `core.schedule.build.eval_microbatches`).
- `rows_split`: whether `rows` split into `micro` equal micro-batches of at least one row (a front
  that lets the engine refuse the batch passes it one micro-batch otherwise).
- `check_rows_per_rank`: a loader's batch per data-parallel rank, refused (before any collective, on
  every rank alike) when it does not split over the ranks or into the micro-batches.
- `loss_shares`: how many losses the engine's step averages into one (micro-batches x ranks): what
  a count over the global batch (labelled tokens, pairs, loss weights) is divided by to give each
  micro-batch's loss its divisor.
"""

from __future__ import annotations

from lightning_zeropp.core.mesh import ParallelDims
from lightning_zeropp.core.schedule.build import eval_microbatches

__all__ = ["call_microbatches", "check_rows_per_rank", "loss_shares", "rows_split"]


def call_microbatches(rows: int, num_microbatches: int, training: bool) -> int:
    """Micro-batches for a call of `rows` rows (one data-parallel rank's)."""
    return num_microbatches if training else eval_microbatches(rows, num_microbatches)


def rows_split(rows: int, micro: int) -> bool:
    """Whether `rows` split into `micro` equal micro-batches (each of one row at least)."""
    return rows >= micro and rows % micro == 0


def check_rows_per_rank(
    size: int, dp_size: int, num_microbatches: int, split_batches: bool, *, how: str | None = None
) -> int:
    """One data-parallel rank's rows of a loader batch of `size`: `size / dp_size` when the
    batch is split over the ranks (`split_batches`), else `size`; refused with the fix when it
    does not split over the ranks, or into `num_microbatches` equal micro-batches. `how`: the
    front's words for how its loader's batch size counts (default: Accelerate's)."""
    mode = "Accelerator(split_batches=True)" if split_batches else "split_batches=False"
    mode = how or mode
    if split_batches and size % dp_size:
        raise ValueError(
            f"batch_size={size} does not split over {dp_size} data-parallel ranks ({mode}); use "
            f"a batch size that is a multiple of {dp_size}."
        )
    per_rank = size // dp_size if split_batches else size
    if per_rank % num_microbatches:
        raise ValueError(
            f"each data-parallel rank gets {per_rank} rows per batch (batch_size={size}, "
            f"dp_size={dp_size}, {mode}), which do not split into num_microbatches="
            f"{num_microbatches} equal micro-batches; use a per-rank batch size that is a "
            f"multiple of {num_microbatches}."
        )
    return per_rank


def loss_shares(micro: int, dims: ParallelDims, *, cp_parts: bool) -> int:
    """How many losses the engine's step averages into one: `micro` micro-batches on each of the
    data-parallel ranks, times the CP ranks when `cp_parts`. A micro-batch's loss that is its sum
    over a count of the global batch (labelled tokens, pairs) divided by `count / loss_shares`
    makes that average the global batch's mean, as one process computes it.

    `cp_parts`: whether each CP rank's loss sums only its part of the tokens (a model's own loss
    in a CP rank's forward: the engine's mean over the CP ranks must then divide by them too).
    A loss computed on whole sequences, the same on every CP rank (Lightning's step under CP),
    is not: averaging equal values over the CP ranks keeps them. A last-stage loss (`use_loss`)
    runs on whole sequences under CP too (`accelerate.last_loss`), a loss over pairs of rows
    (DPO's) included: CP splits the sequence, not the rows.
    """
    return micro * (dims.grad_size if cp_parts else dims.dp_size)
