"""Data in the Lightning front: a training loader that resumes mid-epoch with the next unseen
batch, the check that its batch size splits into the micro-batches (`check_batch_size`), and the
check that a fit had data to train on (`check_trained`).

What Lightning 2.6 does by itself: a checkpoint holds the loops' progress (the epoch, and how many
of its batches were trained, `fit_loop.epoch_loop.batch_progress`), and `fit(ckpt_path=...)`
restores it, so the step count and the epoch continue. The data does not: a plain `DataLoader`
starts its epoch over at batch 0, and the rest of the epoch trains on batches it has already seen
(Lightning only warns). Only loaders with `state_dict` / `load_state_dict` (torchdata's
`StatefulDataLoader`) are saved in the checkpoint and resume where they stopped.

`ZeroPPStrategy.process_dataloader` wraps the training loader in a `ResumingLoader`, which takes
the count from Lightning's own restored progress instead: when an epoch's iteration begins, the
loop's batch progress says how many of this epoch's batches were already trained (0 in a fresh
epoch), and that many are skipped. The sampler's epoch (Lightning sets it on the sampler before the
epoch) makes the order the same as in the interrupted run, so the skipped batches are exactly the
trained ones. Nothing is added to the checkpoint, so any checkpoint resumes this way (sharded,
full, consolidated, or written before this existed), and a checkpoint stays loadable by other
strategies.

Data-parallel ranks each read their own shard (`distributed_sampler_kwargs`), with the same number
of batches per step; every rank's loop has the same count, so each skips its own first batches.
The count is in per-rank batches, so with the same global batch size it names the same samples
under another data-parallel layout too (the sampler's permutation does not depend on the layout).
With another global batch it would not: the checkpoint records its global batch (`BATCH_ROWS`),
and a resume mid-epoch with another one is refused on every rank, naming the rows it would skip
or train twice and the fix (the saved batch size, or a checkpoint at an epoch's end).

A fit that stops inside an epoch (`max_steps`, or `trainer.should_stop`) is written as the
position it stopped at by `stopped_epoch` (on the strategy's save), so that this count resumes it.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader, default_collate

from lightning_zeropp.core.mesh import ParallelDims
from lightning_zeropp.core.step import resumed_rows
from lightning_zeropp.fronts.loader import rebuild_loader
from lightning_zeropp.fronts.microbatches import check_rows_per_rank

__all__ = [
    "BATCH_ROWS",
    "ResumingLoader",
    "batch_rows",
    "check_batch_size",
    "check_trained",
    "resuming_loader",
    "skip_batches",
]

BATCH_ROWS = "zeropp_batch_rows"  # in a checkpoint: rows of one training loader batch, all ranks

_REPLAY_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"


class ResumingLoader:
    """A training loader whose epochs begin after the batches the restored loop already trained.

    Everything else (`len`, `sampler`, `batch_sampler`, `dataset`, attribute assignment) is the
    wrapped loader's, so Lightning sizes the epoch and sets the sampler's epoch as before.
    """

    def __init__(self, loader: Iterable[Any], consumed: Callable[[], int]) -> None:
        object.__setattr__(self, "loader", loader)
        object.__setattr__(self, "_consumed", consumed)

    def __iter__(self) -> Iterator[Any]:
        # A generator: this body runs at the first batch, not at `iter()`. Lightning creates the
        # epoch's iterator before it restores its progress and before it sets the sampler's epoch;
        # both are in place by the time the first batch is fetched.
        yield from skip_batches(self.loader, self._consumed())

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "loader"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets e.g. `worker_init_fn` on the loader it processed: that is the inner one.
        setattr(self.loader, name, value)


def resuming_loader(
    loader: object, trainer: pl.Trainer, saved_rows: Callable[[], int | None] = lambda: None
) -> object:
    """`loader` for `trainer`'s training epochs, resuming mid-epoch (see the module docstring);
    `saved_rows`: the global batch the restored checkpoint recorded (None if it did not).

    Loaders that resume by themselves (`state_dict` / `load_state_dict`, restored by Lightning)
    are returned unchanged: skipping as well would skip twice.
    """
    if isinstance(loader, (_Stateful, ResumingLoader)):
        return loader
    # Lightning warns that resuming mid-epoch with a loader that is not stateful replays batches;
    # this one does not.
    warnings.filterwarnings("ignore", _REPLAY_WARNING, PossibleUserWarning)
    progress = trainer.fit_loop.epoch_loop.batch_progress
    # Here already (the loops' progress is restored before their data is set up): a resume whose
    # new loader has no more batches than the restored count would end the epoch before any
    # batch is fetched, and the check at the first batch would never run.
    check_resumed_rows(
        progress.current.ready, saved_rows(), batch_rows(trainer, loader), trainer.current_epoch
    )

    def consumed() -> int:
        count = progress.current.ready
        check_resumed_rows(count, saved_rows(), batch_rows(trainer, loader), trainer.current_epoch)
        return count

    return ResumingLoader(loader, consumed)  # type: ignore[arg-type]


def batch_rows(trainer: pl.Trainer, loader: object = None) -> int | None:
    """Rows of one training loader batch over all data-parallel ranks, if the loader says."""
    loader = trainer.train_dataloader if loader is None else loader
    size = getattr(loader, "batch_size", None)
    strategy: Any = trainer.strategy  # a ZeroPPStrategy (a ParallelStrategy)
    replicas = strategy.distributed_sampler_kwargs.get("num_replicas", 1)
    return size * replicas if isinstance(size, int) else None


def check_resumed_rows(count: int, saved: int | None, now: int | None, epoch: int) -> None:
    """Refuse (every rank has the same numbers) a resume `count` batches into an epoch whose
    global batch differs from the checkpoint's: skipping `count` batches would skip other rows
    than the trained ones (`core.step.resumed_rows`, the check every front makes)."""
    where = f"this fit resumes {count} batches into epoch {epoch}"
    resumed_rows.check_resumed_rows(count, saved, now, where)


def skip_batches(loader: Iterable[Any], count: int) -> Iterator[Any]:
    """One pass over `loader` without its first `count` batches.

    A plain `DataLoader` over a map-style dataset skips them as indices (its batch sampler's first
    `count` batches are drawn but no sample is loaded or collated); any other iterable loads and
    drops them.
    """
    if count <= 0:
        return iter(loader)
    if type(loader) is DataLoader and loader.batch_sampler is not None:
        return iter(_without_first(loader, count))
    return itertools.islice(iter(loader), count, None)


class _SkipFirst:
    """A batch sampler without the first `count` batches of another."""

    def __init__(self, batch_sampler: Iterable[list[int]], count: int) -> None:
        self.batch_sampler, self.count = batch_sampler, count

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.count, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.count)  # type: ignore[arg-type]


def _without_first(loader: DataLoader, count: int) -> DataLoader:
    """A one-pass copy of `loader` over its own batch sampler (so the sampler's epoch, set on the
    original, holds) without the first `count` batches."""
    assert loader.batch_sampler is not None  # the caller checked
    return rebuild_loader(loader, batch_sampler=_SkipFirst(loader.batch_sampler, count))


def check_trained(trainer: pl.Trainer) -> None:
    """A fit that ended normally without one training batch was not meant: say so, on every
    rank (each rank's loader has the same length), instead of exiting 0 with an untrained model.
    `limit_train_batches=0` and `max_steps=0` ask for no training and are left alone."""
    state = trainer.state
    if state.fn != TrainerFn.FITTING or state.status != TrainerStatus.RUNNING:
        return
    if trainer.limit_train_batches == 0 or trainer.max_steps == 0:
        return
    if trainer.num_training_batches == 0:
        raise ValueError(
            "the training dataloader gave no batches on this data-parallel rank, so fit trained "
            "0 steps: the dataset is smaller than one batch per data-parallel rank (with "
            "drop_last=True, or after the sampler split it). Use more data, a smaller "
            "batch_size, or drop_last=False."
        )


def check_batch_size(trainer: pl.Trainer, loader: object, dims: ParallelDims, micro: int) -> None:
    """A training loader whose batch (each data-parallel rank's: Lightning's sampler shards the
    rows) does not split into `num_microbatches` is refused when the loop sets it up, on every
    rank alike (the batch size is the same on each), with the check every front makes
    (`fronts.microbatches.check_rows_per_rank`). A short last batch reaches the engine's own
    check at its step. So does a batch whose rows are not the loader's `batch_size`: a loader
    that does not say it, a `collate_fn` of the user's (a pre-batched dataset, a packing or
    pair-stacking collate) or a batch-transfer hook of the module's or the datamodule's."""
    size = getattr(loader, "batch_size", None)
    if not isinstance(size, int) or getattr(loader, "collate_fn", None) is not default_collate:
        return
    owners = (trainer.lightning_module, getattr(trainer, "datamodule", None))
    if any(is_overridden(hook, owner) for hook in _BATCH_HOOKS for owner in owners if owner):
        return
    how = "the loader's batch_size is per rank"
    check_rows_per_rank(size, dims.dp_size, micro, split_batches=False, how=how)


# What may change a batch's rows between the loader and the training step.
_BATCH_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
