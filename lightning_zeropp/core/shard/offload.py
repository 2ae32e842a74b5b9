"""Activation offload: a stage's saved activations held in host memory between its forward and
its backward, with torch's own mechanism (`torch.autograd.graph.saved_tensors_hooks`, as
torch's `save_on_cpu`, torchtitan and torchtune use it).

The stage's `forward` is wrapped in place (as activation checkpointing wraps a block's): while it
runs, every tensor autograd saves for backward is copied to host memory and the device copy is
left to be freed; backward copies it back. The values are the same bytes, so a run with offload
gives bit-identical losses and gradients. Weights are not copied (parameters, and views of them:
FSDP's gathered weights are freed and gathered by FSDP itself), nor tensors already off the
device, nor tensor subclasses (DTensor).

On a GPU the copy to host runs on a side stream that waits for the compute stream, into pinned
memory, so it overlaps the next kernels; the device tensor is recorded on that stream so its
memory is not reused before the copy is done, and the copy back waits for an event of it (on the
compute stream: the backward's reload is not prefetched). That path cannot be run here without a
GPU: it is written as torch's documentation prescribes and is the part of this module to check on
one. On a CPU device "host" and "device" are the same memory: the copy is a clone, which keeps
the path (and its accounting) exercised by the CPU tests.

`OffloadStats` counts what the hooks moved: bytes copied to host in all, and the host bytes held
at once (live, peak). Tensors the hooks keep on the device are handed to an enclosing tracker
(`core.measure.memory.SavedActivations`, via `keep_observer`), whose hooks these shadow, so the
memory report's activation peak counts what stays on the device.
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

from lightning_zeropp.core._torch_private import view_base

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
    """Bytes the offload hooks of one rank moved: `moved` copied to host in all, `live` held on
    the host now, `peak` the most held at once (`reset_peak` starts a new measurement)."""

    moved: int = 0
    live: int = 0
    peak: int = 0
    tensors: int = 0

    def reset_peak(self) -> None:
        self.peak = self.live

    def _add(self, nbytes: int) -> None:
        self.moved += nbytes
        self.tensors += 1
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _drop(self, nbytes: int) -> None:
        self.live -= nbytes


class _HostCopies:
    """The pack and unpack hooks of one rank's offloading stages."""

    def __init__(self, device: torch.device, stats: OffloadStats) -> None:
        self.device = device
        self.stats = stats
        self._stream: Any = None  # the side stream of the copies to host, made on first use

    def _moves(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, nn.Parameter) or isinstance(view_base(tensor), nn.Parameter):
            return False  # weights: FSDP frees and gathers them
        if type(tensor) is not torch.Tensor:
            return False  # a subclass (DTensor) is kept whole
        if any(st == 0 and n > 1 for st, n in zip(tensor.stride(), tensor.shape, strict=True)):
            # an expanded tensor (SDPA's memory-efficient kernel saves its broadcast mask so):
            # a copy keeping its strides cannot be written, and it holds little memory itself
            return False
        return tensor.device.type == self.device.type

    def pack(self, tensor: torch.Tensor) -> Any:
        if not self._moves(tensor):
            kept = _KEEP[-1](tensor) if _KEEP else tensor
            return ("kept", kept)
        host, event = self._to_host(tensor)
        nbytes = host.untyped_storage().nbytes()
        self.stats._add(nbytes)
        weakref.finalize(host, self.stats._drop, nbytes)  # freed with autograd's saved copy
        return ("host", tensor.device, host, event)

    def unpack(self, packed: Any) -> torch.Tensor:
        if packed[0] == "kept":
            return packed[1]
        _, device, host, event = packed
        if device.type != "cuda":
            return host  # a CPU device: the clone is the tensor (used as saved, never changed)
        # The copy back runs on the compute stream once the copy to host is done.
        torch.cuda.current_stream(device).wait_event(event)
        return host.to(device, non_blocking=True)

    def _to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        # The copy keeps the tensor's strides: a compiled backward checks its saved tensors'
        # strides (a view into a wider tensor, as attention's q of a fused qkv, would come back
        # contiguous from a plain clone); a view's gaps are allocated with it.
        host = torch.empty_strided(
            tensor.size(),
            tensor.stride(),
            dtype=tensor.dtype,
            device="cpu",
            pin_memory=tensor.device.type == "cuda",
        )
        if tensor.device.type != "cuda":
            host.copy_(tensor.detach())
            return host, None
        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is written
        with torch.cuda.stream(stream):
            host.copy_(tensor.detach(), non_blocking=True)
        tensor.record_stream(stream)  # its memory is not reused before the copy is done
        event = torch.cuda.Event()
        event.record(stream)
        return host, event


def apply_activation_offload(stage: nn.Module, device: torch.device, stats: OffloadStats) -> None:
    """Keep `stage`'s saved activations in host memory between its forward and backward.

    `forward` is wrapped in place (parameter names do not change), inside FSDP's hooks: the
    gathered weights are parameters and stay where FSDP put them."""
    hooks = _HostCopies(device, stats)
    forward = stage.forward

    @functools.wraps(forward)
    def offloaded(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)  # nothing is saved for backward
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            return forward(*args, **kwargs)

    stage.forward = offloaded  # type: ignore[method-assign]
