"""Data under a pipeline: batches split over data-parallel ranks only, and the example micro-batch.

All stages of one pipeline must see the same batch (the first feeds it to the model, the last
computes the loss with its targets), so a loader is sharded over `dp_size` ranks with index
`dp_rank`, not over all processes. Accelerate's own `prepare_data_loader` does the sharding, with
the Accelerator's settings (`split_batches`, `even_batches`, seedable sampler, device placement).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, IterableDataset

from lightning_zeropp.core.mesh import ParallelDims
from lightning_zeropp.fronts.loader import rebuild_loader
from lightning_zeropp.fronts.microbatches import check_rows_per_rank

__all__ = [
    "Unpack",
    "check_loader",
    "example_microbatch",
    "shard_loader",
    "unpack_batch",
    "widen_loader",
]

# batch -> (model positional args, model keyword args, target)
Unpack = Callable[[Any], tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]]


def unpack_batch(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]:
    """`(inputs, targets)` or `{"input_ids": ..., "labels": ..., **model_kwargs}`.

    `inputs` may itself be a tuple of positional model inputs. Other keys of a dict batch (e.g.
    `attention_mask`) are passed to the model as keyword arguments.
    """
    if isinstance(batch, Mapping):
        if "input_ids" not in batch or "labels" not in batch:
            raise ValueError(
                f"a dict batch needs 'input_ids' and 'labels' keys; got {sorted(batch)}. Pass "
                "prepare_pipeline(..., unpack=lambda b: ((model_args...), {model_kwargs}, target))."
            )
        kwargs = {k: v for k, v in batch.items() if k not in ("input_ids", "labels")}
        return (batch["input_ids"],), kwargs, batch["labels"]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, target = batch
        args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        return args, {}, target
    raise TypeError(
        f"cannot read a batch of type {type(batch).__name__} (expected (inputs, targets) or a dict "
        "with 'input_ids' and 'labels'); pass prepare_pipeline(..., unpack=fn) with fn(batch) -> "
        "((model_args...), {model_kwargs}, target)."
    )


def rows_per_rank(loader: DataLoader, split_batches: bool, dp_size: int) -> int | None:
    """Rows of one batch on one data-parallel rank, if the loader says its batch size."""
    size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
    if size is None:
        return None
    return size // dp_size if split_batches else size


def check_loader(
    loader: DataLoader,
    split_batches: bool,
    dp_size: int,
    num_microbatches: int,
    fills_last: bool = False,
) -> None:
    """Batch-size checks every rank makes from its own loader, before any collective.

    `fills_last`: Accelerate completes a short last batch (`even_batches`) and the stages take
    any shape (not traced), so a dataset length that is no multiple of the batch is fine.
    """
    size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
    if size is None:
        return  # a batch sampler without a batch size: the engine checks each batch instead
    check_rows_per_rank(size, dp_size, num_microbatches, split_batches)
    per_step = size if split_batches else size * dp_size
    length = _length(loader.dataset)
    if length is not None and (length == 0 or (loader.drop_last and length < per_step)):
        # Every rank sees the same length: all raise, instead of a loop that trains 0 steps
        # and exits 0 with the initial weights.
        drop = (" with drop_last=True", ", or drop_last=False") if loader.drop_last else ("", "")
        raise ValueError(
            f"the training dataset has {length} rows, fewer than one step's {per_step} "
            f"({dp_size} data-parallel ranks x {per_step // dp_size} rows){drop[0]}: the loop "
            f"would train 0 steps. Use more data or a smaller batch_size{drop[1]}."
        )
    if not fills_last and not loader.drop_last and length is not None and length % per_step:
        raise ValueError(
            f"the dataset's {length} rows leave a last batch smaller than {per_step} rows; "
            "pipeline stages fix their shapes at the first step. Pass drop_last=True to the "
            "DataLoader."
        )


def example_microbatch(
    loader: DataLoader, rows: int, unpack: Unpack
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Model inputs of one micro-batch: the dataset's first `rows` samples, collated.

    Read from the dataset, not by iterating the loader: a loader's iterator may draw from the
    random generators that decide the shuffling order, which would change the training data.
    """
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        samples = list(itertools.islice(iter(dataset), rows))
    else:
        length = _length(dataset)
        samples = [dataset[i] for i in range(min(rows, length if length is not None else rows))]
    if len(samples) < rows:
        raise ValueError(
            f"the dataset has fewer than {rows} samples, one micro-batch; pass example_args."
        )
    args, kwargs, _ = unpack(loader.collate_fn(samples))
    return args, kwargs


def shard_loader(accelerator: Accelerator, loader: DataLoader, dims: ParallelDims) -> DataLoader:
    """`loader` for this rank's data-parallel shard, with the Accelerator's data settings."""
    if accelerator.dispatch_batches:
        raise ValueError(
            "Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True)) sends "
            "each process its own slice of rank 0's batch, but pipeline stages of one data-"
            "parallel rank need the same batch. Leave dispatch_batches unset (or False)."
        )
    return prepare_data_loader(
        loader,
        accelerator.device,
        num_processes=dims.dp_size,
        process_index=dims.dp_rank,
        split_batches=accelerator.split_batches,
        put_on_device=accelerator.device_placement,
        rng_types=list(accelerator.rng_types),
        dispatch_batches=False,
        even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )


def widen_loader(loader: DataLoader, factor: int) -> DataLoader:
    """The same loader reading `factor` batches' rows at once (same sampler, same order).

    Under DDP each of a step's processes loads one batch; the ranks of one pipeline share a
    batch, so a data-parallel rank loads the rows its `pp_size` processes would have loaded.
    The prepared loader has DDP's length and yields one batch per step, so a loop's counts are in
    its batches as under DDP: run_clm's `resume_step` passed to
    `accelerator.skip_first_batches(train_dataloader, resume_step)` skips exactly the steps
    already trained (tests/distributed/test_resume.py).
    """
    if factor == 1:
        return loader
    if loader.batch_size is None:
        raise ValueError(
            "the training loader has a custom batch_sampler; ZeroPPAccelerator sizes batches per "
            "process (each data-parallel rank reads pp_size batches' rows). Use batch_size=..., "
            "or prepare_pipeline, whose batches are per data-parallel rank."
        )
    return rebuild_loader(loader, batch_size=loader.batch_size * factor)


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None
