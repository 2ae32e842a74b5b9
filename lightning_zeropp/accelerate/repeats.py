"""The samples Accelerate repeats to complete a short last batch (`even_batches`), which one
process never sees: how many end this data-parallel rank's batch (`repeated_samples`), and a
batch with their labels masked (`without_repeated_rows`), for a loss every process gets over the
global batch (a last-stage loss, a packed row's loss).

`gather_for_metrics` drops the repeats from what has a value per row; a loss that is one number
for the global batch must leave them out itself. Of the loader being iterated (Accelerate's
`GradientState`), the global batch's first `remainder` samples are real; data-parallel rank i
holds samples [i*B, (i+1)*B) of it (B: the loader's batch size per rank). A sample is told apart
only where it is one row, or one packed document: where the batch holds another number of them
(a collator making two rows of a sample, packed samples of several documents), or where the
labels cannot be masked (floating point), a batch holding repeats is refused, naming the fix,
rather than counted. An iterable dataset's loader has no remainder (Accelerate cannot know its
length): its repeats count, as under DDP."""

from __future__ import annotations

from typing import Any

import torch

from lightning_zeropp.fronts.hf_loss import IGNORE_INDEX
from lightning_zeropp.fronts.packing import documents, is_packed

__all__ = ["real_samples", "repeated_samples", "samples_per_rank", "without_repeated_rows"]


def samples_per_rank(state: Any, dp_size: int) -> int | None:
    """B: the samples each data-parallel rank's batch holds, of the loader being iterated."""
    total = getattr(getattr(state, "active_dataloader", None), "total_batch_size", None)
    return int(total) // dp_size if isinstance(total, int) and total > 0 else None


def real_samples(state: Any, dp_rank: int, dp_size: int) -> int | None:
    """How many samples of data-parallel rank `dp_rank`'s current batch are the dataset's own, in
    a short last batch over several ranks; None where all are (`state`: Accelerate's
    `GradientState`, or an object with `end_of_dataloader`, `remainder`, `active_dataloader`).
    Over one data-parallel rank Accelerate shards nothing: the last batch is short, not
    completed. Over several, each rank's last batch is completed to B samples (`even_batches`;
    without it, a rank's last batch holds its real samples only)."""
    if dp_size == 1 or not (state.end_of_dataloader and state.remainder > 0):
        return None
    per = samples_per_rank(state, dp_size)
    if per is None:
        return None
    return min(max(state.remainder - dp_rank * per, 0), per)


def repeated_samples(state: Any, dp_rank: int, dp_size: int, samples: int) -> int:
    """Of the `samples` samples that end data-parallel rank `dp_rank`'s current batch, how many
    Accelerate repeated (`real_samples`): the batch's first ones are its real samples."""
    real = real_samples(state, dp_rank, dp_size)
    return 0 if real is None else max(samples - real, 0)


def without_repeated_rows(
    inputs: dict[str, Any], state: Any, dp_rank: int, dp_size: int
) -> dict[str, Any]:
    """`inputs` with the labels of the rows, or packed documents, Accelerate repeated masked
    (-100): a loss that skips -100 labels then counts them in neither its sum nor its count. The
    batch as given where nothing is repeated or it has no labels. Raises `ValueError` where the
    repeats cannot be told apart (see the module's docstring)."""
    real = real_samples(state, dp_rank, dp_size)
    labels = inputs.get("labels")
    if real is None or not isinstance(labels, torch.Tensor) or labels.dim() == 0:
        return inputs
    per = samples_per_rank(state, dp_size)
    assert per is not None  # a short last batch: the loader has a batch size
    packed = is_packed(inputs)
    units = documents(inputs["position_ids"]) if packed else None
    count = len(units) if units is not None else labels.shape[0]
    # one unit a sample: the real ones first; more units than samples: unknown, unless none of
    # this rank's samples is repeated
    repeated = max(count - real, 0) if count <= per else per - real
    if repeated == 0:
        return inputs
    if count > per or labels.is_floating_point():
        what = f"{count} packed documents" if packed else f"{count} rows"
        why = (
            "floating-point labels, which cannot be masked"
            if labels.is_floating_point()
            else f"{what}, which are not one per sample"
        )
        raise ValueError(
            f"the last evaluation batch of data-parallel rank {dp_rank} holds {per} samples, "
            f"{repeated} of them repeated by Accelerate to complete it (one process never sees "
            f"them), and {why}: the repeats cannot be left out of the global batch's loss. Use "
            f"an evaluation set whose size is a multiple of the global batch ({per * dp_size} "
            "samples), or drop the short last batch (dataloader_drop_last=True; drop_last=True "
            "in a DataLoader)."
        )
    masked = labels.clone()
    if units is not None:
        for row, start, end in units[count - repeated :]:
            masked[row, start:end] = IGNORE_INDEX
    else:
        masked[count - repeated :] = IGNORE_INDEX
    return {**inputs, "labels": masked}
