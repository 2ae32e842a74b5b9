"""Rebuilding a user's `DataLoader` with one thing changed, keeping everything else it was given.

Both fronts re-create loaders: the Accelerate front widens a loader to the rows of `pp_size`
processes' batches, the Lightning front skips the batches a resumed epoch already trained. A copy
that lists the constructor's arguments by hand drops the ones added later (`pin_memory_device`,
`in_order` were lost that way), so the fields are read off `DataLoader.__init__`'s own signature.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

__all__ = ["rebuild_loader"]

# Given only through other fields: `shuffle` became the sampler; the batch sampler Lightning or
# the DataLoader made from `batch_size` is made again from it.
_DERIVED = ("self", "shuffle")
_AUTO_BATCHING = ("batch_size", "sampler", "drop_last")
_WORKERS_ONLY = ("prefetch_factor", "persistent_workers")


def rebuild_loader(loader: DataLoader, **changes: Any) -> DataLoader:
    """A new `DataLoader` with every constructor field of `loader`, and `changes` applied.

    A `batch_sampler` among the changes replaces the automatic batching (`batch_size`,
    `sampler`, `drop_last`); otherwise a loader built with `batch_size` keeps its sampler and gets
    its batch sampler made anew.
    """
    names = [n for n in inspect.signature(DataLoader.__init__).parameters if n not in _DERIVED]
    fields = {n: getattr(loader, n) for n in names if hasattr(loader, n)}
    fields.update(changes)
    if changes.get("batch_sampler") is not None or fields.get("batch_size") is None:
        for name in _AUTO_BATCHING:
            fields.pop(name, None)
    else:
        fields.pop("batch_sampler", None)
    if isinstance(loader.dataset, IterableDataset):
        # Its sampler is the DataLoader's own stand-in, which the constructor refuses back.
        fields.pop("sampler", None)
    if not fields.get("num_workers"):  # DataLoader refuses these without workers
        for name in _WORKERS_ONLY:
            fields.pop(name, None)
    return DataLoader(**fields)
