"""An emulated accelerator for CPU ranks: each block's compute is a timed wait, the rest is real.

A GPU runs its kernels on a stream while the host queues more work; the host waits only where it
needs a result. `EmulatedDevice` is that stream as a clock: `launch(seconds)` queues a task and
returns at once, `sync()` sleeps until everything queued has "run". Blocks of a model are given
their costs by `emulate_blocks`: a block's forward launches its forward seconds, its backward
launches the input-gradient seconds (I) and, on a separate autograd path through a one-element
parameter of the block, the weight-gradient seconds (W), so torch's split backward (I now, W
later) launches each where it runs. Recomputation re-runs the forward, so it launches it again.

Tensors stay real (tiny), and so do sends, receives, gathers and reductions (gloo). `install`
makes the host wait for the device where a GPU's would: a send leaves once the device has
produced what it sends (a background thread holds it until then, in order, so the host keeps
queuing), and a collective other than a parameter all-gather starts once the device is idle
(its input is computed). A parameter all-gather reads the sharded weights, which the device is
not writing, so it starts at once and overlaps the queued compute, as FSDP's prefetch does on a
GPU. Because the waits release the CPU, eight ranks behave like eight devices on two cores as
long as each host keeps ahead of its device.

What a GPU does that this does not: a reduce-scatter blocks the host here (gloo's is
synchronous), so FSDP's per-block gradient reductions during backward do not overlap the
compute queued after them; and messages cost what the emulated link makes them cost.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

__all__ = ["BlockCost", "EmulatedDevice", "emulate_blocks", "install"]

_MODULES = (dist, c10d)
# Collectives whose input the device computed: they start once the device is idle.
_SYNCED = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_object", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "barrier", "send", "broadcast_object_list",
    "gather_object",
)  # fmt: skip


@dataclass(frozen=True)
class BlockCost:
    """Seconds one micro-batch costs a block: forward, input gradient, weight gradient."""

    forward: float
    input_grad: float
    weight_grad: float


@dataclass
class EmulatedDevice:
    """One rank's compute stream as a clock (`time.perf_counter` seconds, shared by the ranks of
    one machine)."""

    free_at: float = 0.0  # when the last queued task ends
    busy: float = 0.0  # seconds of tasks queued so far
    late: float = 0.0  # seconds the device sat idle while the host was busy, not waiting
    spans: list[tuple[str, float, float]] = field(default_factory=list)  # (kind, start, end)
    host_waits: list[tuple[str, float, float]] = field(default_factory=list)  # recorded waits
    record: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _waits: list[tuple[float, float]] = field(default_factory=list)  # host waiting: (from, to)

    def __deepcopy__(self, memo: dict[int, Any]) -> EmulatedDevice:
        return self  # one device per process: copies of a model (stage splitting) share it

    def launch(self, seconds: float, kind: str) -> None:
        """Queue `seconds` of compute; returns at once."""
        if seconds <= 0:
            return
        with self._lock:
            now = time.perf_counter()
            if now > self.free_at:  # idle since free_at: waiting for data, or for the host?
                waited = sum(max(0.0, min(b, now) - max(a, self.free_at)) for a, b in self._waits)
                self.late += max(0.0, now - self.free_at - waited)
            self._waits.clear()
            start = max(self.free_at, now)
            self.free_at = start + seconds
            self.busy += seconds
            if self.record:
                self.spans.append((kind, start, self.free_at))

    def sync(self) -> None:
        """Wait (sleeping, so the CPU is free) until every queued task has run."""
        while (left := self.free_at - time.perf_counter()) > 0:
            time.sleep(left)

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """The host waits for others here (a receive, a collective): not the host's lateness."""
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            with self._lock:
                self._waits.append((start, end))
                if self.record:
                    self.host_waits.append((what, start, end))


# ------------------------------------------------------------------------------ blocks
class _InputPath(torch.autograd.Function):
    """Identity on a block's output; its backward is the block's input-gradient cost."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, device: EmulatedDevice, seconds: float) -> torch.Tensor:
        ctx.device, ctx.seconds = device, seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.device.launch(ctx.seconds, "I")
        return grad, None, None


class _WeightPath(torch.autograd.Function):
    """A zero from a block's one-element parameter; its backward is the block's weight-gradient
    cost (a node on the weight path only, so split backward runs it in W)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, device: EmulatedDevice, seconds: float) -> torch.Tensor:
        ctx.device, ctx.seconds = device, seconds
        return w.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.device.launch(ctx.seconds, "W")
        return grad.new_zeros(1), None, None


def emulate_blocks(
    blocks: Sequence[nn.Module], costs: Sequence[BlockCost], device: EmulatedDevice
) -> None:
    """Give each block its cost: a forward hook launches the forward and routes the block's
    output through the input-gradient path; the weight-gradient path joins (x + 0) the output
    of the block's first submodule that holds parameters. It joins inside the block, not at
    its output: split backward's W starts from the nodes where weight paths branch off, and
    the block's output carries FSDP's pre-backward hook, which must not run again in W."""
    for block, cost in zip(blocks, costs, strict=True):
        block.register_parameter("emulated_weight", nn.Parameter(torch.zeros(1)))
        inner = [m for m in block.modules() if m is not block and m._parameters]
        if not inner:
            raise ValueError(f"{type(block).__name__} has no submodule with parameters")
        inner[0].register_forward_hook(
            functools.partial(_join_weight_path, block=block, device=device, cost=cost)
        )
        block.register_forward_hook(functools.partial(_block_hook, device=device, cost=cost))


def _block_hook(
    module: nn.Module, args: Any, output: Any, *, device: EmulatedDevice, cost: BlockCost
) -> Any:
    device.launch(cost.forward, "F")
    hidden = output[0] if isinstance(output, tuple) else output
    if not (isinstance(hidden, torch.Tensor) and hidden.requires_grad):
        return None  # forward only (evaluation, shape inference without grad)
    hidden = _InputPath.apply(hidden, device, cost.input_grad)
    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


def _join_weight_path(
    module: nn.Module,
    args: Any,
    output: Any,
    *,
    block: nn.Module,
    device: EmulatedDevice,
    cost: BlockCost,
) -> Any:
    if not (isinstance(output, torch.Tensor) and output.requires_grad):
        return None
    w = block.emulated_weight
    return output + _WeightPath.apply(w.to(output.dtype), device, cost.weight_grad)


# ------------------------------------------------------------------------------ communication
class _Sender:
    """Sends wait for the device to produce what they send, in order, off the host's thread."""

    def __init__(self, device: EmulatedDevice, isend: Callable[..., Any]) -> None:
        self.device, self.isend = device, isend
        self.jobs: queue.Queue[_DeferredSend | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="emulated-sender")
        self.thread.start()

    def submit(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _DeferredSend:
        job = _DeferredSend(self.device.free_at, args, kwargs)
        self.jobs.put(job)
        return job

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            while (left := job.ready_at - time.perf_counter()) > 0:
                time.sleep(left)
            try:
                job.work = self.isend(*job.args, **job.kwargs)
            except BaseException as err:  # handed to whoever waits on it
                job.error = err
            job.issued.set()

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)


class _DeferredSend:
    """What `isend` returns while the send waits for the device: a Work-like handle."""

    def __init__(self, ready_at: float, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.ready_at, self.args, self.kwargs = ready_at, args, kwargs
        self.issued = threading.Event()
        self.work: Any = None
        self.error: BaseException | None = None

    def wait(self, timeout: Any = None) -> bool:
        self.issued.wait()
        if self.error is not None:
            raise self.error
        return self.work.wait() if self.work is not None else True

    def is_completed(self) -> bool:
        return self.issued.is_set() and (self.work is None or self.work.is_completed())

    def is_success(self) -> bool:
        return self.error is None


class _TimedWork:
    """A receive's Work whose waits count as the host waiting for others."""

    def __init__(self, work: Any, device: EmulatedDevice) -> None:
        self.work, self.device = work, device

    def wait(self, *args: Any) -> Any:
        with self.device.waiting("recv"):
            return self.work.wait(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


@contextlib.contextmanager
def install(device: EmulatedDevice) -> Iterator[None]:
    """Patch `torch.distributed` (and `distributed_c10d`, which `P2POp` checks against) so that
    communication waits for the device as a GPU's does (module docstring); undone on exit."""
    saved: list[tuple[Any, str, Any]] = []
    sender = _Sender(device, c10d.isend)

    def patch(name: str, fn: Callable[..., Any]) -> None:
        for module in _MODULES:
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, fn)

    @functools.wraps(c10d.isend)
    def isend(*args: Any, **kwargs: Any) -> Any:
        return sender.submit(args, kwargs)

    irecv_original = c10d.irecv

    @functools.wraps(c10d.irecv)
    def irecv(*args: Any, **kwargs: Any) -> Any:
        work = irecv_original(*args, **kwargs)
        return _TimedWork(work, device) if work is not None else None

    patch("isend", isend)
    patch("irecv", irecv)
    patch("recv", _waited(c10d.recv, device))
    patch("all_gather_into_tensor", _waited(c10d.all_gather_into_tensor, device))
    patch("all_gather_single", _waited(c10d.all_gather_single, device))
    for name in _SYNCED:
        if hasattr(c10d, name):
            patch(name, _after_device(getattr(c10d, name), device))
    try:
        yield
    finally:
        sender.close()
        while saved:
            module, name, original = saved.pop()
            setattr(module, name, original)


def _after_device(fn: Callable[..., Any], device: EmulatedDevice) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        with device.waiting(fn.__name__):
            if group is None or dist.get_world_size(group) > 1:  # a group of one moves nothing
                device.sync()
            return fn(*args, **kwargs)

    return wrapper


def _waited(fn: Callable[..., Any], device: EmulatedDevice) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with device.waiting(fn.__name__):
            return fn(*args, **kwargs)

    return wrapper
