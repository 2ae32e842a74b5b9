"""One batch per pipeline: every stage of a pipeline steps on its first stage's batch.

The ranks of a pipeline read the same rows and collate them themselves. A collator that draws
(random masking, augmentation) draws from each rank's own random state, and those part as soon
as the stages' work differs (dropout in other blocks): the first stage would feed one mask while
the last computes the loss against another. Synchronising the random state before each
collation would cover torch's generator in the loader's own process only: collators also draw
in worker processes (seeded from a base seed each rank draws from its own state), from numpy,
from Python's `random` or from generators of their own. So the batch itself is sent:
`BatchSharer.share` gives every rank of the pipeline the first stage's batch, whatever drew it:
its structure in one small object broadcast, then each tensor in one broadcast, over the
pipeline group, written into the rank's own tensors where the shapes agree (so what a loop
reads of its batch afterwards, labels for metrics, is the batch the pipeline trained on). It
costs the batch's bytes once per step (token ids: 8 bytes a token), far below the activations
the schedule sends per micro-batch.

`ZEROPP_CHECK_BATCH=1`, for debugging, compares a checksum of what each stage steps on over the
pipeline group (one small gather per check) and raises on every rank naming the first entry
and the ranks that differ (`BatchSharer.check`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_zeropp.core.step.failure import raised_everywhere

__all__ = ["BatchSharer"]


@dataclass(frozen=True)
class _Slot:
    """Where a tensor sat in a batch: its place in the broadcast order, shape and dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool


class BatchSharer:
    """Shares and checks batches over one pipeline's ranks (`group`; its rank 0 is the first
    stage's). `check`: compare checksums at every `check` call (`ZEROPP_CHECK_BATCH`)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        check: bool = False,
        guard: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.group = group
        self.device = device
        self.checking = check
        self._guard = guard
        self._size = dist.get_world_size(group) if group is not None else 1

    def share(self, batch: Any) -> Any:
        """Collective over the pipeline: the first stage's `batch`, on every rank. A rank whose
        own batch has the same structure and shapes gets it written into its own tensors (and
        back the same object); otherwise a new batch of the first stage's structure."""
        if self._size == 1:
            return batch
        mine: list[torch.Tensor] = []
        skeleton = _strip(batch, mine)
        first = dist.get_rank(self.group) == 0
        meta = [skeleton if first else None]
        with self._guard():
            dist.broadcast_object_list(meta, group=self.group, group_src=0, device=self._obj_dev)
            theirs = meta[0]
            same = first or _same(skeleton, theirs)
            slots: list[_Slot] = []
            _slots(theirs, slots)
            received: list[torch.Tensor] = []
            for slot in slots:
                own = mine[slot.index] if same else None
                received.append(self._broadcast(slot, own))
        return batch if same else _fill(theirs, received)

    def check(self, value: Any, what: str, root: str = "batch") -> None:
        """With `ZEROPP_CHECK_BATCH=1`, collective over the pipeline: raise on every rank if
        `value` (a batch, or what a step computed from it: its entries named from `root`)
        differs between its stages."""
        if not self.checking or self._size == 1:
            return
        entries = _digests(value, root)
        everyone: list[Any] = [None] * self._size
        with self._guard():
            dist.all_gather_object(everyone, entries, group=self.group)
        for rank, seen in enumerate(everyone):
            if seen != everyone[0]:
                raise raised_everywhere(ValueError(_difference(everyone[0], seen, rank, what)))

    @property
    def _obj_dev(self) -> torch.device | None:
        return self.device if self.device.type != "cpu" else None

    def _broadcast(self, slot: _Slot, own: torch.Tensor | None) -> torch.Tensor:
        """One tensor from the first stage: into `own` where given (in place), else new."""
        direct = own is not None and own.device == self.device and own.is_contiguous()
        if own is not None and direct:
            buf = own
        elif own is not None:
            buf = own.detach().to(self.device).contiguous()
        else:
            buf = torch.empty(slot.shape, dtype=slot.dtype, device=self.device)
        # Not every backend sends booleans (gloo): their bytes are the same as uint8's.
        dist.broadcast(
            buf.view(torch.uint8) if buf.dtype == torch.bool else buf,
            group=self.group,
            group_src=0,
        )
        if own is not None:
            if buf is not own:
                with torch.no_grad():
                    own.copy_(buf)
            return own
        return buf.cpu() if slot.on_cpu else buf


# ---------------------------------------------------------------------------------- structure
def _strip(value: Any, tensors: list[torch.Tensor]) -> Any:
    """A copy of `value` with each tensor replaced by its `_Slot` (appended to `tensors`)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1, tuple(value.shape), value.dtype, value.device.type == "cpu")
    if isinstance(value, Mapping):
        out = copy.copy(value)  # keeps the mapping's type (a BatchEncoding stays one)
        items = {k: _strip(v, tensors) for k, v in value.items()}
        if isinstance(out, MutableMapping):
            out.update(items)
            return out
        return items
    if isinstance(value, (list, tuple)):
        return _rebuilt(value, [_strip(v, tensors) for v in value])
    return value


def _slots(value: Any, out: list[_Slot]) -> None:
    if isinstance(value, _Slot):
        out.append(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _slots(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _slots(v, out)


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` (a received skeleton, this rank's own copy) with its slots' tensors put back."""
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, MutableMapping):
        for k in list(value):
            value[k] = _fill(value[k], tensors)
        return value
    if isinstance(value, (list, tuple)):
        return _rebuilt(value, [_fill(v, tensors) for v in value])
    return value


def _rebuilt(value: list | tuple, items: list[Any]) -> Any:
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*items)
    return type(value)(items)


def _same(a: Any, b: Any) -> bool:
    """Whether two skeletons have the same structure, shapes, dtypes and other values."""
    if type(a) is not type(b):
        return False
    if isinstance(a, Mapping):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:  # values without a truth of equality (arrays): take the first stage's
        return False


# ---------------------------------------------------------------------------------- checksums
def _digests(value: Any, path: str = "batch") -> list[tuple[str, str]]:
    """(where, checksum) of every leaf: a tensor's shape, dtype and bytes; other values' repr."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        digest = hashlib.sha256(data.tobytes()).hexdigest()[:16]
        return [(path, f"{tuple(value.shape)} {value.dtype} sha256:{digest}")]
    if isinstance(value, Mapping):
        return [e for k, v in value.items() for e in _digests(v, f"{path}[{k!r}]")]
    if isinstance(value, (list, tuple)):
        return [e for i, v in enumerate(value) for e in _digests(v, f"{path}[{i}]")]
    return [(path, repr(value)[:200])]


def _difference(first: list, seen: list, rank: int, what: str) -> str:
    where, a, b = "the entries", f"{len(first)} entries", f"{len(seen)} entries"
    for (path_a, sum_a), (path_b, sum_b) in zip(first, seen, strict=False):
        if (path_a, sum_a) != (path_b, sum_b):
            where, a, b = (
                (path_a, sum_a, sum_b) if path_a == path_b else ("the entries", path_a, path_b)
            )
            break
    return (
        f"ZEROPP_CHECK_BATCH: {what} differs between the stages of a pipeline: {where} is "
        f"{a} on its first stage (pipeline rank 0) and {b} on pipeline rank {rank}. The stages "
        "would train on different data. Something drew it apart after the batch was shared: "
        "draw random values in the step with torch's generator (which the stages share), not "
        "numpy's or Python's random, and pass the model the batch the loader yielded."
    )
