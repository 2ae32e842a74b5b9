"""Rebuilt loaders keep every field the user gave (both fronts rebuild through one function)."""

from __future__ import annotations

import inspect

import torch
from torch.utils.data import DataLoader, RandomSampler

from lightning_zeropp.accelerate.data import widen_loader
from lightning_zeropp.fronts.loader import rebuild_loader
from lightning_zeropp.lightning.data import _without_first, skip_batches


def _collate(rows):
    return torch.stack(rows)


def _init_worker(_):
    pass


def _user_loader(num_workers: int = 0) -> DataLoader:
    """A loader with a non-default value in every field DataLoader takes."""
    data = [torch.full((2,), float(i)) for i in range(12)]
    workers = {"prefetch_factor": 3, "persistent_workers": True} if num_workers else {}
    return DataLoader(
        data,
        batch_size=2,
        sampler=RandomSampler(data, generator=torch.Generator().manual_seed(0)),
        num_workers=num_workers,
        collate_fn=_collate,
        pin_memory=False,
        drop_last=True,
        timeout=5.0 if num_workers else 0,
        worker_init_fn=_init_worker,
        generator=torch.Generator().manual_seed(1),
        pin_memory_device="cpu",
        in_order=False,
        **workers,
    )


def _fields(loader: DataLoader) -> dict[str, object]:
    names = [n for n in inspect.signature(DataLoader.__init__).parameters if n != "self"]
    skip = {"shuffle", "batch_sampler", "batch_size", "drop_last"}  # the changed ones
    return {n: getattr(loader, n) for n in names if n not in skip and hasattr(loader, n)}


def test_every_field_survives_a_rebuild():
    for workers in (0, 2):
        loader = _user_loader(workers)
        wider = rebuild_loader(loader, batch_size=4)
        assert wider.batch_size == 4 and wider.drop_last
        assert _fields(wider) == _fields(loader)
        assert wider.pin_memory_device == "cpu" and wider.in_order is False


def test_both_fronts_rebuild_with_every_field():
    loader = _user_loader()
    widened = widen_loader(loader, 3)  # the Accelerate front: pp_size batches' rows at once
    assert widened.batch_size == 6 and _fields(widened) == _fields(loader)
    resumed = _without_first(loader, 2)  # the Lightning front: a resumed epoch's rest
    fields = {k: v for k, v in _fields(resumed).items() if k != "sampler"}
    assert fields == {k: v for k, v in _fields(loader).items() if k != "sampler"}
    assert len(resumed) == len(loader) - 2 == len(list(skip_batches(loader, 2)))


def test_an_iterable_dataset_rebuilds():
    """An IterableDataset's loader has torch's stand-in sampler, which its constructor refuses."""
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    wider = rebuild_loader(DataLoader(Stream(), batch_size=2), batch_size=4)
    assert next(iter(wider)).tolist() == [0, 1, 2, 3]


def test_a_resume_mid_epoch_with_another_global_batch_says_what_it_would_skip() -> None:
    import pytest

    from lightning_zeropp.lightning.data import check_resumed_rows

    # pp 4, 2 data-parallel ranks: saved with 16 rows a batch (3 batches: 48 rows trained),
    # resumed with 32: skipping 3 batches would skip 96 rows, 48 never trained.
    with pytest.raises(ValueError, match=r"saved with a global batch of 16 rows \(48 rows trained"
                       r".*global batch is 32 rows.*skip 96 rows, 48 of them never trained"
                       r".*Resume with the batch size"):  # fmt: skip
        check_resumed_rows(3, 16, 32, epoch=0)
    with pytest.raises(ValueError, match=r"skip 24 rows and train 24 trained rows again"):
        check_resumed_rows(3, 16, 8, epoch=0)
    check_resumed_rows(3, 16, 16, epoch=0)  # the same batch: the trained rows, exactly
    check_resumed_rows(0, 16, 32, epoch=1)  # at an epoch's start nothing is skipped
    check_resumed_rows(3, None, 32, epoch=0)  # a checkpoint from before the record: as before
