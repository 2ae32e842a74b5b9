"""Packed and variable-length HF batches under a pipeline: rows the micro-batches can split, of
lengths from a bounded set.

A pipeline splits a batch's rows into `num_microbatches` equal parts, and each new batch shape
costs a new schedule (torch's stages fix their shapes at their first step; the engine keeps 8).
Two HF habits clash with that, and both are reshaped here, exactly:

- **Packed rows** (`DataCollatorWithFlattening`: the batch's documents concatenated into one
  row, `position_ids` restarting at 0 for each, the first label of each document -100). With
  no attention mask, HF attends within each document only (`find_packed_sequence_indices`), so
  the documents may be regrouped: `pack_rows` cuts the row between documents into as many rows
  as the micro-batches need, each a run of whole documents, balanced by length, padded at the
  end with a document of padding (labels -100, positions from 0, attending to itself only).
  Every token keeps its document, its position and its target: the loss is one process's.
- **Lengths that change every step** (padding to the longest row): `bucket_length` rounds the
  length up to a bucket (`seq_buckets`), and the batch is padded at the end of each row (labels
  -100, attention mask 0, positions continued). For a causal LM no real token attends to a later
  one, so the padding changes no loss, logit or gradient; the number of shapes, and so of
  schedules built, is bounded by the number of buckets.

`Reshaped.restore(outputs)` maps per-token outputs (logits) back onto the batch as given.
Duck-typed on HF's key names; nothing here imports transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_zeropp.fronts.hf_loss import IGNORE_INDEX

__all__ = [
    "SeqBuckets",
    "Reshaped",
    "bucket_length",
    "check_buckets",
    "documents",
    "is_packed",
    "reshape",
]

# None: lengths as they come; "pow2": the next power of two; an int k: the next multiple of k;
# a list: the next listed length (a longer batch keeps its own).
SeqBuckets = str | int | Sequence[int] | None

# How padding fills each per-token key; other keys with a sequence dimension are refused.
_PAD = {
    "input_ids": 0,
    "labels": IGNORE_INDEX,
    "shift_labels": IGNORE_INDEX,
    "attention_mask": 0,
    "token_type_ids": 0,
}
# Keys packed rows may carry that describe the packing itself: regrouping would make them wrong.
_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def check_buckets(buckets: SeqBuckets) -> SeqBuckets:
    """`buckets` if valid; else a `ValueError` naming it and the accepted forms."""
    ok = (
        buckets is None
        or buckets == "pow2"
        or (isinstance(buckets, int) and not isinstance(buckets, bool) and buckets > 0)
        or (
            isinstance(buckets, (list, tuple))
            and len(buckets) > 0
            and all(isinstance(b, int) and b > 0 for b in buckets)
        )
    )
    if not ok:
        raise ValueError(
            f"seq_buckets={buckets!r}: use None (lengths as they come), 'pow2' (the next power "
            "of two), a positive int k (the next multiple of k) or a list of lengths."
        )
    return buckets


def bucket_length(length: int, buckets: SeqBuckets) -> int:
    """The length a sequence of `length` tokens is padded to."""
    if buckets is None:
        return length
    if buckets == "pow2":
        return 1 << max(length - 1, 0).bit_length()
    if isinstance(buckets, int):
        return -(-length // buckets) * buckets
    assert not isinstance(buckets, str)  # check_buckets refuses strings other than "pow2"
    fits = [b for b in sorted(buckets) if b >= length]
    return fits[0] if fits else length


def is_packed(batch: dict[str, Any]) -> bool:
    """Documents concatenated along rows: `position_ids` restart inside a row, no 2-D mask."""
    pos = batch.get("position_ids")
    if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[1] < 2:
        return False
    if batch.get("attention_mask") is not None:
        return False  # HF reads packing from positions only without a mask
    return bool((pos[:, 1:] != pos[:, :-1] + 1).any())


@dataclass
class Reshaped:
    """A batch as the pipeline runs it, and how its tokens map back onto the batch as given:
    token (i, j) of the given batch sits at `(rows[i, j], cols[i, j])`; without them, rows are
    unchanged but for padding at their end, cropped back to `length` (None: no padding)."""

    batch: dict[str, Any]
    length: int | None = None
    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None

    def restore(self, outputs: torch.Tensor) -> torch.Tensor:
        """Per-token `outputs` (rows, length, ...) back in the given batch's layout."""
        if self.rows is None or self.cols is None:
            return outputs if self.length is None else outputs[:, : self.length]
        return outputs[self.rows.to(outputs.device), self.cols.to(outputs.device)]


def reshape(batch: dict[str, Any], row_multiple: int, buckets: SeqBuckets) -> Reshaped:
    """`batch` with rows a multiple of `row_multiple` (packed rows regrouped) and its length
    padded to a bucket. A batch needing neither comes back as it is."""
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return Reshaped(batch)
    rows, length = ids.shape
    if is_packed(batch) and rows % row_multiple:
        return _pack_rows(batch, row_multiple, buckets)
    target = bucket_length(length, buckets)
    if target == length:
        return Reshaped(batch)
    return Reshaped(_pad(batch, length, target, packed=is_packed(batch)), length)


def _pad(batch: dict[str, Any], length: int, target: int, packed: bool) -> dict[str, Any]:
    """Every per-token tensor padded at the end of its rows to `target`."""
    out = dict(batch)
    extra = target - length
    for key, value in batch.items():
        if not _per_token(value, batch["input_ids"]):
            continue
        if key == "position_ids":
            start = 0 if packed else length  # packed: the padding is a document of its own
            tail = torch.arange(start, start + extra, device=value.device, dtype=value.dtype)
            out[key] = torch.cat([value, tail.expand(value.shape[0], extra)], dim=1)
        elif key in _PAD:
            out[key] = torch.nn.functional.pad(value, (0, extra), value=_PAD[key])
        else:
            raise ValueError(
                f"the batch's {key!r} has a value per token, which seq_buckets cannot pad (it "
                f"pads {sorted(_PAD)} and position_ids); set seq_buckets=None."
            )
    return out


def _pack_rows(batch: dict[str, Any], num_rows: int, buckets: SeqBuckets) -> Reshaped:
    """Packed rows regrouped into `num_rows` runs of whole documents, padded to one length."""
    refused = [k for k in _PACKING_KEYS if k in batch]
    if refused:
        raise ValueError(
            f"the packed batch carries {refused}, which describe its packing: regrouping its "
            "documents into the pipeline's micro-batches would make them wrong. Build the "
            "collator without them (DataCollatorWithFlattening(return_flash_attn_kwargs=False, "
            "return_seq_idx=False)); HF reads the documents from position_ids."
        )
    ids, pos = batch["input_ids"], batch["position_ids"]
    keys = [k for k, v in batch.items() if _per_token(v, ids)]
    unknown = [k for k in keys if k not in _PAD and k != "position_ids"]
    if unknown:
        raise ValueError(
            f"the packed batch's {unknown} have a value per token, which cannot be regrouped "
            f"(known: {sorted(_PAD)}, position_ids); drop them from the batch."
        )
    docs = documents(pos)  # (row, start, end) of each document, in order
    _check_separated(batch, docs)
    groups = _balanced(docs, num_rows)
    width = bucket_length(max(sum(e - s for _, s, e in g) for g in groups), buckets)
    out = {k: v for k, v in batch.items() if k not in keys}
    where_row, where_col = torch.empty_like(ids), torch.empty_like(ids)
    new_rows: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    for r, group in enumerate(groups):
        col = 0
        for row, start, end in group:
            where_row[row, start:end] = r
            where_col[row, start:end] = torch.arange(col, col + end - start)
            col += end - start
        for k in keys:
            pieces = [batch[k][row, start:end] for row, start, end in group]
            pieces.append(_padding(k, width - col, batch[k]))
            new_rows[k].append(torch.cat(pieces))
    for k in keys:
        out[k] = torch.stack(new_rows[k])
    return Reshaped(out, ids.shape[1], where_row, where_col)


def _padding(key: str, size: int, like: torch.Tensor) -> torch.Tensor:
    """`size` padding tokens of `key`; positions restart at 0: the padding is its own document."""
    if key == "position_ids":
        return torch.arange(size, dtype=like.dtype, device=like.device)
    return torch.full((size,), _PAD[key], dtype=like.dtype, device=like.device)


def _per_token(value: Any, ids: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == ids.shape


def documents(pos: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of each document of packed rows' `position_ids`, in order."""
    docs: list[tuple[int, int, int]] = []
    for row in range(pos.shape[0]):
        p = pos[row]
        starts = [0, *(torch.nonzero(p[1:] != p[:-1] + 1).flatten() + 1).tolist()]
        ends = [*starts[1:], p.shape[0]]
        docs.extend((row, s, e) for s, e in zip(starts, ends, strict=True))
    return docs


def _check_separated(batch: dict[str, Any], docs: list[tuple[int, int, int]]) -> None:
    """Regrouping keeps every target only if no document's first label is one (HF's
    separator, -100): the token before it would otherwise have been trained to predict it."""
    labels = batch.get("labels")
    if labels is None or "shift_labels" in batch:
        return
    firsts = torch.stack([labels[row, start] for row, start, _ in docs])
    if bool((firsts != IGNORE_INDEX).any()):
        raise ValueError(
            "packed rows whose documents start with a label other than -100 train each "
            "document's last token to predict the next document's first: regrouping the "
            "documents would change that. Use DataCollatorWithFlattening's default "
            "separator_id=-100."
        )


def _balanced(docs: list[tuple[int, int, int]], num_rows: int) -> list[list[Any]]:
    """Documents, in order, cut into `num_rows` runs whose longest is as short as possible."""
    sizes = [e - s for _, s, e in docs]

    def runs(capacity: int) -> list[list[Any]]:
        out: list[list[Any]] = [[]]
        used = 0
        for doc, size in zip(docs, sizes, strict=True):
            if used + size > capacity and out[-1]:
                out.append([])
                used = 0
            out[-1].append(doc)
            used += size
        return out

    low, high = max(sizes), sum(sizes)
    while low < high:  # the least capacity that needs no more than num_rows runs
        mid = (low + high) // 2
        low, high = (low, mid) if len(runs(mid)) <= num_rows else (mid + 1, high)
    groups = runs(low)
    return groups + [[] for _ in range(num_rows - len(groups))]
