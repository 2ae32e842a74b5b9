"""Count the collectives and point-to-point messages a rank issues, by kind and mesh axis.

`CommCounter` is a context manager: while it is active, the public `torch.distributed` collective
functions are replaced (on both `torch.distributed` and `torch.distributed.distributed_c10d`) by
wrappers that record one call and its bytes before calling the original; on exit, even on an
exception, the original functions are put back.

    with CommCounter(mesh_axis_namer(engine.dims.mesh)) as comm:  # `measure.axes`
        engine.train_step(x, target=y)
    comm.summary()  # {"all_gather": {"dp_shard": {"count": 18, "bytes": ...}}, "send": {...}}

Bytes convention: the payload *this rank* hands to the call, whatever the algorithm moves on the
wire. All-gather: the input shard. Reduce-scatter: the full (unreduced) input. All-reduce and
broadcast: the tensor (on every rank, source or not). All-to-all: the input. Send / isend: the
tensor sent (kind "send"); recv / irecv: the buffer received into (kind "recv"). Barrier: 0.
`batch_isend_irecv` counts each of its `P2POp`s as one send or recv. A collective called from
inside another (the deprecated `all_gather_into_tensor` calls `all_gather_single`, and
`batch_isend_irecv` calls `isend`/`irecv`) is counted once, at the outermost call.

What is seen: every call made through `dist.<name>` or `distributed_c10d.<name>` attribute look-up,
which is how FSDP2 (`fsdp/_fully_shard/_fsdp_collectives.py`: `dist.all_gather_single`,
`dist.reduce_scatter_single`, `dist.all_reduce` for HSDP) and the pipelining runtime
(`dist.P2POp(dist.isend/irecv)` in `stage.py`; `p.op(...)` or `dist.batch_isend_irecv` in
`schedules.py`; `dist.send/recv`) call them in torch 2.13: neither imports a collective by name.
What is not seen: (1) calls through a name imported before entering (`from torch.distributed import
all_reduce`), and a `P2POp` built before entering whose `op` is then called directly; (2)
functional collectives (DTensor redistribution such as `full_tensor()`, the norm of DTensor
gradients), which dispatch to `torch.ops._c10d_functional`; (3) collectives issued from C++, e.g.
DDP's reducer: register DDP's `allreduce_hook` comm hook to route its buckets through
`dist.all_reduce`. Caveats of patching: `P2POp(fn, ...)` accepts only the current module-level
`isend`/`irecv`, so building one inside the context from a by-name import of the original raises;
a `P2POp` built inside holds the wrapper, so hand it to `batch_isend_irecv` inside the context.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed import ProcessGroup

__all__ = [
    "AxisNamer",
    "CommCounter",
    "CommEvent",
    "KINDS",
    "PLUS_AXES",
]

# Groups the library creates beside the mesh, named by their description: ZeRO++'s hpZ
# partitions (a DeviceMesh dimension, described "mesh_hpz") and its two-hop subgroups.
PLUS_AXES = ("hpz", "zeropp_plus_intra", "zeropp_plus_cross")

AxisNamer = Callable[[ProcessGroup | None], str]


class CommEvent(NamedTuple):
    """One counted call and when it ran (`time.perf_counter()` seconds). An asynchronous call
    (`async_op=True`, isend/irecv) spans its launch only; its wait shows up where it is waited on."""

    kind: str
    axis: str
    nbytes: int
    start: float
    end: float


# function name -> (kind it is counted as, argument whose tensor bytes are counted)
_SPECS: dict[str, tuple[str, str | None]] = {
    "all_gather_into_tensor": ("all_gather", "input_tensor"),
    "all_gather_single": ("all_gather", "input_tensor"),
    "all_gather": ("all_gather", "tensor"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "all_to_all_single": ("all_to_all", "input"),
    "all_to_all": ("all_to_all", "input_tensor_list"),
    "send": ("send", "tensor"),
    "isend": ("send", "tensor"),
    "recv": ("recv", "tensor"),
    "irecv": ("recv", "tensor"),
    "barrier": ("barrier", None),
}
_MODULES = (dist, c10d)

# Every kind a summary can hold, in a fixed order (metrics keys must agree across ranks).
KINDS: tuple[str, ...] = tuple(dict.fromkeys(kind for kind, _ in _SPECS.values()))


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


def _root(fn: Any) -> Any:
    """The torch function under any number of (nested counters') wrappers."""
    while hasattr(fn, "_comm_original"):
        fn = fn._comm_original
    return fn


def _default_axis(group: ProcessGroup | None) -> str:
    if group is None or group is dist.group.WORLD:
        return "world"
    desc = getattr(group, "group_desc", "")
    return desc if desc and desc != "undefined" else group.group_name


class CommCounter:
    """Record (count, bytes) per (kind, axis) of the collectives issued while active.

    `axis_of_group(group)` names the group a call runs on (see `mesh_axis_namer`); by default the
    default group is "world" and any other group goes by its description or name. Counters may be
    nested (both record) if they exit in reverse order of entry.
    """

    def __init__(
        self, axis_of_group: AxisNamer | None = None, events: list[CommEvent] | None = None
    ) -> None:
        self._axis_of_group = axis_of_group or _default_axis
        self._events = events  # when given, every counted call is appended with its wall-clock
        self._stats: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        self._lock = threading.Lock()  # backward hooks may issue collectives on other threads
        self._local = threading.local()  # per-thread depth: count the outermost call only
        self._saved: list[tuple[Any, str, Any]] = []
        self._active = False

    # ------------------------------------------------------------------ context
    def __enter__(self) -> CommCounter:
        if self._active:
            raise RuntimeError("this CommCounter is already active")
        originals = {
            n: getattr(c10d, n) for n in [*_SPECS, "batch_isend_irecv"] if hasattr(c10d, n)
        }
        for name, fn in originals.items():
            wrapper = self._wrap(name, fn)
            for module in _MODULES:
                if hasattr(module, name):
                    self._saved.append((module, name, getattr(module, name)))
                    setattr(module, name, wrapper)
        self._active = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._active = False  # wrappers still referenced (e.g. by a P2POp) stop recording
        while self._saved:
            module, name, original = self._saved.pop()
            setattr(module, name, original)

    # ------------------------------------------------------------------ results
    def summary(self) -> dict[str, dict[str, dict[str, int]]]:
        """{kind: {axis: {"count": calls, "bytes": bytes}}}, sorted by kind then axis."""
        with self._lock:
            items = sorted(self._stats.items())
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (kind, axis), (count, nbytes) in items:
            out.setdefault(kind, {})[axis] = {"count": count, "bytes": nbytes}
        return out

    def reset(self) -> None:
        with self._lock:
            self._stats.clear()

    # ------------------------------------------------------------------ internals
    def _record(self, kind: str, group: ProcessGroup | None, nbytes: int) -> str:
        axis = self._axis_of_group(group)
        with self._lock:
            entry = self._stats[(kind, axis)]
            entry[0] += 1
            entry[1] += nbytes
        return axis

    def _timed(
        self,
        kind: str,
        axis: str,
        nbytes: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        if self._events is None:
            return self._call(fn, args, kwargs)
        start = time.perf_counter()
        try:
            return self._call(fn, args, kwargs)
        finally:
            self._events.append(CommEvent(kind, axis, nbytes, start, time.perf_counter()))

    def _outermost(self) -> bool:
        return self._active and getattr(self._local, "depth", 0) == 0

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._local.depth -= 1

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if name == "batch_isend_irecv":
            wrapper = self._wrap_batch(fn)
        else:
            kind, arg = _SPECS[name]
            signature = inspect.signature(fn)

            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if self._outermost():
                    try:
                        bound = signature.bind(*args, **kwargs).arguments
                    except TypeError:  # bad arguments: let torch raise its own error
                        bound = None
                    if bound is not None:
                        nbytes = _nbytes(bound.get(arg)) if arg else 0
                        axis = self._record(kind, bound.get("group"), nbytes)
                        return self._timed(kind, axis, nbytes, fn, args, kwargs)
                return self._call(fn, args, kwargs)

        wrapper._comm_original = fn  # type: ignore[attr-defined]
        return wrapper

    def _wrap_batch(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(p2p_op_list: list[dist.P2POp]) -> Any:
            send = _root(c10d.isend)
            outermost, total, axis = self._outermost(), 0, "other"
            if outermost:
                for op in p2p_op_list:
                    kind = "send" if _root(op.op) is send else "recv"
                    axis = self._record(kind, op.group, _nbytes(op.tensor))
                    total += _nbytes(op.tensor)
            # torch tells sends from receives by `op.op is isend` (the patched module global):
            # hand it ops that use the current global, whichever function they were built with.
            ops = [
                _with_op(op, c10d.isend if _root(op.op) is send else c10d.irecv)
                for op in p2p_op_list
            ]
            if outermost:
                return self._timed("send_recv", axis, total, fn, (ops,), {})
            return self._call(fn, (ops,), {})

        return wrapper


def _with_op(op: dist.P2POp, fn: Callable[..., Any]) -> dist.P2POp:
    if op.op is fn:
        return op
    copy = object.__new__(type(op))  # P2POp.__new__ re-validates `op`; the caller's op stays as is
    copy.__dict__.update(op.__dict__)
    copy.op = fn
    return copy
