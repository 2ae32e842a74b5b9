"""Activation offload: a stage's saved activations held in host memory between its forward and
its backward, with torch's own mechanism (`torch.autograd.graph.saved_tensors_hooks`, as
torch's `save_on_cpu`, torchtitan and torchtune use it).

The stage's `forward` is wrapped in place (as activation checkpointing wraps a block's): while it
runs, every tensor autograd saves for backward goes to host memory and the device copy is left to
be freed; backward gets it back. Weights are not copied (parameters, and views of them: FSDP
frees and gathers them itself), nor tensors already off the device, nor tensor subclasses.

One host copy per storage and stage forward: what is copied is the storage under a saved tensor
(its bytes, as the device held them), once however many saved tensors view it (one input read
by q, k and v projections; q, k and v as views of one fused qkv), keyed by the storage and its
version counter (a storage written in place after its copy is copied again); each saved tensor
comes back as the same view (size, strides, offset) of the storage's copy. The values are the
same bytes, so a run with offload gives bit-identical losses and gradients, and the host holds
what the device would have (the planner's per-storage bytes, `plan.activations`).

Copies back: where a stage's backward is one task (1F1B, GPipe, interleaved 1F1B), the copy back
of a micro-batch's storages starts when its backward starts (a hook on the stage's outputs'
gradient, `register_multi_grad_hook`), last saved first, so the last blocks' backward overlaps
the earlier blocks' copies; each storage's device copy is freed once the backward has released
every tensor saved from it. Where the backward is split (I, then W, which read the saved tensors
again), each read copies back when it comes, on the compute stream.

Streams (`_Lane`): on a GPU the copies to host run on one side stream, into pinned memory, after
the compute stream's work so far, and the device storage is recorded on it (its memory is not
reused before the copy is done); the copies back run on a second side stream after the copy to
host's event, into memory of that stream, and the compute stream waits for a storage's event
(and records the storage) before it reads it. On other devices a lane runs the same calls with
no stream: the copies are done when they return. The CPU tests run that path (same bytes, same
views, same accounting); the CUDA stream calls cannot run here and are written as torch's
documentation prescribes: the part of this module to check on a GPU first.

`OffloadStats` counts what the hooks moved. Tensors they keep on the device are handed to an
enclosing tracker (`core.measure.memory.SavedActivations`, via `keep_observer`), whose hooks
these shadow, so the memory report's activation peak counts what stays on the device.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_zeropp.core._torch_private import tensor_version, view_base

__all__ = ["OffloadStats", "apply_activation_offload", "keep_observer"]

# What an enclosing saved-tensor tracker does with a tensor these hooks keep on the device.
_KEEP: list[Callable[[torch.Tensor], torch.Tensor]] = []


@contextlib.contextmanager
def keep_observer(pack: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """While active, tensors the offload hooks keep on the device go through `pack` (what an
    outer `saved_tensors_hooks` would have done: inner hooks shadow outer ones)."""
    _KEEP.append(pack)
    try:
        yield
    finally:
        _KEEP.remove(pack)


@dataclass
class OffloadStats:
    """What the offload hooks of one rank moved: `moved` bytes copied to host in all, `live`
    held on the host now, `peak` the most held at once (`reset_peak` starts a new measurement);
    `tensors` saved tensors sent to host, `storages` host copies made (one per storage and stage
    forward); `fetched_ahead` bytes copied back as a backward started (prefetched),
    `fetched_late` bytes copied back when a backward read them."""

    moved: int = 0
    live: int = 0
    peak: int = 0
    tensors: int = 0
    storages: int = 0
    fetched_ahead: int = 0
    fetched_late: int = 0

    def reset_peak(self) -> None:
        self.peak = self.live

    def _add(self, nbytes: int) -> None:
        self.moved += nbytes
        self.storages += 1
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _drop(self, nbytes: int) -> None:
        self.live -= nbytes


class _Lane:
    """One direction's copies: a side stream of its own on CUDA; elsewhere no stream (a copy is
    done when it returns), through the same calls."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: Any = None

    def run(
        self, copy: Callable[[], torch.Tensor], reads: torch.Tensor | None, after: Any
    ) -> tuple[torch.Tensor, Any]:
        """`copy()` on this lane, after the compute stream's work so far when `reads` (a device
        tensor it reads) is given, and after the event `after`: its result and its end event."""
        if self.device.type != "cuda":
            return copy(), None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        if reads is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # `reads` is written
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            out = copy()  # memory allocated here belongs to this stream
        if reads is not None:
            reads.record_stream(stream)  # not reused before the copy is done
        event = torch.cuda.Event()
        event.record(stream)
        return out, event


def _ready(tensor: torch.Tensor, event: Any) -> torch.Tensor:
    """`tensor` (a lane's result) for the compute stream: it waits for the copy's event, and the
    allocator keeps the memory until the compute stream is done with it."""
    if event is not None:
        current = torch.cuda.current_stream(tensor.device)
        current.wait_event(event)
        tensor.record_stream(current)
    return tensor


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Copy:
    """One storage's host copy (`host`, done at `event`) and, once fetched, its device copy."""

    def __init__(self, source: torch.UntypedStorage, version: int, host: torch.Tensor) -> None:
        self.source = weakref.ref(source)
        self.device = source.device  # where it comes back to (cuda:N, as the tensor was)
        self.version = version
        self.host = host
        self.event: Any = None
        self.fetched: torch.Tensor | None = None  # the copy back, started ahead of its reads
        self.fetch_event: Any = None
        self.late: weakref.ref[torch.UntypedStorage] | None = None  # copied back as read


class _Batch:
    """One stage forward's host copies: by storage and version (while the storage lives), and
    in the order they were made (a storage freed within the forward gives its id to another)."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[int, int], _Copy] = {}
        self.copies: list[_Copy] = []


class _HostCopies:
    """The pack and unpack hooks of one rank's offloading stages."""

    def __init__(self, device: torch.device, stats: OffloadStats) -> None:
        self.device = device
        self.stats = stats
        self.to_host = _Lane(device)
        self.to_device = _Lane(device)

    def _moves(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, nn.Parameter) or isinstance(view_base(tensor), nn.Parameter):
            return False  # weights: FSDP frees and gathers them
        if type(tensor) is not torch.Tensor:
            return False  # a subclass (DTensor) is kept whole
        return tensor.device.type == self.device.type

    def pack(self, batch: _Batch, tensor: torch.Tensor) -> Any:
        """Into `batch` (this stage forward's copies, by storage and version), once each."""
        if not self._moves(tensor):
            kept = _KEEP[-1](tensor) if _KEEP else tensor
            return ("kept", kept)
        storage, version = tensor.untyped_storage(), tensor_version(tensor)
        copy = batch.by_key.get((id(storage), version))
        if copy is None or copy.source() is not storage:  # new, or a dead storage's id
            copy = self._to_host(storage, version)
            batch.by_key[id(storage), version] = copy
            batch.copies.append(copy)
        self.stats.tensors += 1
        view = (tensor.dtype, tensor.storage_offset(), tensor.size(), tensor.stride())
        return ("host", copy, view)

    def unpack(self, packed: Any) -> torch.Tensor:
        if packed[0] == "kept":
            return packed[1]
        _, copy, (dtype, offset, size, stride) = packed
        if copy.fetched is not None:
            storage = _ready(copy.fetched, copy.fetch_event).untyped_storage()
        else:
            storage = self._fetch_now(copy)
        empty = torch.empty(0, dtype=dtype, device=storage.device)
        return empty.set_(storage, offset, size, stride)

    def _fetch_now(self, copy: _Copy) -> torch.UntypedStorage:
        """Not prefetched: copied back on the compute stream as a backward reads it, once while
        a tensor read from it lives (q, k and v of one storage, read by one node)."""
        alive = copy.late() if copy.late is not None else None
        if alive is not None:
            return alive
        if copy.event is not None:
            torch.cuda.current_stream(copy.device).wait_event(copy.event)
        data = torch.empty_like(copy.host, device=copy.device)
        data.copy_(copy.host, non_blocking=copy.event is not None)
        self.stats.fetched_late += data.numel()
        copy.late = weakref.ref(data.untyped_storage())
        return data.untyped_storage()

    def prefetch(self, batch: _Batch) -> None:
        """Start copying back every storage of one stage forward (its backward starts): the
        last saved first, as the backward reads them. The device copies live as long as the
        saved tensors that view them."""
        copies = batch.copies
        batch.copies, batch.by_key = [], {}  # from here the saved tensors alone keep the copies
        for copy in reversed(copies):
            if copy.fetched is not None:
                continue
            back = functools.partial(self._device_copy, copy.host, copy.device)
            copy.fetched, copy.fetch_event = self.to_device.run(back, None, copy.event)
            self.stats.fetched_ahead += copy.host.numel()

    @staticmethod
    def _device_copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return torch.empty_like(host, device=device).copy_(host, non_blocking=True)

    def _to_host(self, storage: torch.UntypedStorage, version: int) -> _Copy:
        source = _bytes(storage)
        host = torch.empty(
            source.numel(),
            dtype=torch.uint8,
            device="cpu",
            pin_memory=self.device.type == "cuda",
        )
        copy = _Copy(storage, version, host)
        _, copy.event = self.to_host.run(
            lambda: host.copy_(source, non_blocking=True), source, None
        )
        self.stats._add(host.numel())
        weakref.finalize(copy, self.stats._drop, host.numel())  # freed with the saved tensors
        return copy


def apply_activation_offload(
    stage: nn.Module, device: torch.device, stats: OffloadStats, prefetch: bool = True
) -> None:
    """Keep `stage`'s saved activations in host memory between its forward and backward.

    `forward` is wrapped in place (parameter names do not change), inside FSDP's hooks: the
    gathered weights are parameters and stay where FSDP put them. `prefetch`: copy a forward's
    storages back as its backward starts (for a backward that is one task; a split one reads
    its saved tensors in two tasks, and copies back as it reads)."""
    hooks = _HostCopies(device, stats)
    forward = stage.forward

    @functools.wraps(forward)
    def offloaded(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)  # nothing is saved for backward
        batch = _Batch()
        with torch.autograd.graph.saved_tensors_hooks(
            functools.partial(hooks.pack, batch), hooks.unpack
        ):
            out = forward(*args, **kwargs)
        if prefetch and batch.copies:
            _on_backward(out, functools.partial(hooks.prefetch, batch))
        return out

    stage.forward = offloaded  # type: ignore[method-assign]


def _on_backward(out: Any, start: Callable[[], None]) -> None:
    """Call `start` when the first gradient of `out`'s tensors is computed: when the backward of
    the forward that gave `out` starts."""
    from lightning_zeropp.core._torch_private import tree_flatten

    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if tensors:
        torch.autograd.graph.register_multi_grad_hook(tensors, lambda _: start(), mode="any")
