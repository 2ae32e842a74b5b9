"""What each rank holds and needs, measured: the memory report of a pipelined model.

At setup a front prints, per rank, the bytes of its parameter shards and of the gradients it will
hold; after the first update, what was measured: gradients and optimizer state held, the most
gathered (unsharded) weight bytes and the most bytes saved for backward (activations) seen at
once during that step, and the peak the process reached (the device allocator's on a GPU, the
resident set on the host). The planner predicts these; this is what they are checked against.
"""

from __future__ import annotations

import resource
import sys
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_zeropp.core._torch_private import unsharded_parameter_bytes, view_base
from lightning_zeropp.core.shard.fsdp import local_shard
from lightning_zeropp.core.shard.offload import keep_observer

__all__ = [
    "GatheredPeak",
    "RankMemory",
    "SavedActivations",
    "host_peak_bytes",
    "measure",
    "format_report",
    "model_state_bytes",
]


@dataclass
class RankMemory:
    rank: int
    parameters: int  # bytes of this rank's parameter shards
    gradients: int  # bytes of gradient shards held (before a step: what they will take)
    optimizer: int  # bytes of optimizer state tensors held (0 before the first update)
    gathered_peak: int | None  # most unsharded weight bytes at once in a measured step
    activation_peak: int | None  # most bytes saved for backward at once (weights excluded)
    peak: int  # the device allocator's peak on a GPU, the process's peak resident set on CPU
    peak_kind: str  # "device" or "host"
    # most saved-activation bytes held in host memory at once (offloading ranks; None: none)
    host_activation_peak: int | None = None


def host_peak_bytes() -> int:
    """The process's peak resident set size so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def _local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    shards = (local_shard(t) for t in tensors)
    return sum(s.numel() * s.element_size() for s in shards)


def model_state_bytes(
    parameters: Iterable[nn.Parameter],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (local shards only)."""
    params = list(parameters)
    if optimizer is None:
        optimizers: Sequence[torch.optim.Optimizer] = ()
    elif isinstance(optimizer, torch.optim.Optimizer):
        optimizers = (optimizer,)
    else:
        optimizers = optimizer
    state = (v for opt in optimizers for s in opt.state.values() for v in s.values())
    return {
        "parameters": _local_bytes(params),
        "gradients": _local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_state": _local_bytes(v for v in state if isinstance(v, torch.Tensor)),
    }


def measure(
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    device: torch.device,
    gathered_peak: int | None = None,
    activation_peak: int | None = None,
    host_activation_peak: int | None = None,
) -> RankMemory:
    """This rank's figures (no communication)."""
    params = list(module.parameters())
    held = model_state_bytes(params, optimizers)
    grad_bytes = held["gradients"]
    if not any(p.grad is not None for p in params):  # before a step: what they will take
        grad_bytes = _local_bytes(p for p in params if p.requires_grad)
    if device.type == "cuda":
        peak, kind = torch.cuda.max_memory_allocated(device), "device"
    else:
        peak, kind = host_peak_bytes(), "host"
    rank = dist.get_rank() if dist.is_initialized() else 0
    return RankMemory(
        rank,
        held["parameters"],
        grad_bytes,
        held["optimizer_state"],
        gathered_peak,
        activation_peak,
        peak,
        kind,
        host_activation_peak,
    )


def format_report(mine: RankMemory, title: str) -> str:
    """Collective: every rank's figures, one line each (the same text on every rank)."""
    everyone: list[Any] = [asdict(mine)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, asdict(mine))
    lines = [f"memory per rank ({title}; MiB):"]
    for m in everyone:
        gathered = "-" if m["gathered_peak"] is None else _mib(m["gathered_peak"])
        saved = "-" if m["activation_peak"] is None else _mib(m["activation_peak"])
        if m.get("host_activation_peak") is not None:  # an offloading rank: the device's share
            saved += f" (+ {_mib(m['host_activation_peak'])} offloaded to host)"
        lines.append(
            f"  rank {m['rank']}: parameters {_mib(m['parameters'])}, gradients "
            f"{_mib(m['gradients'])}, optimizer state {_mib(m['optimizer'])}, gathered weights "
            f"peak {gathered}, activations peak {saved}, {m['peak_kind']} peak {_mib(m['peak'])}"
        )
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


class GatheredPeak:
    """Samples the unsharded (gathered) weight bytes of `stages` whenever one of their FSDP units
    starts its forward, while active; `peak` is the most seen at once."""

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        self._stages = list(stages)
        self._handles: list[Any] = []
        self.peak = 0

    def __enter__(self) -> GatheredPeak:
        for stage in self._stages:
            for unit in stage.modules():
                if isinstance(unit, FSDPModule):  # after FSDP's own hook: weights are gathered
                    self._handles.append(unit.register_forward_pre_hook(self._sample))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _sample(self, *_: Any) -> None:
        now = sum(unsharded_parameter_bytes(stage) for stage in self._stages)
        self.peak = max(self.peak, now)


class SavedActivations:
    """Bytes of the tensors autograd saves for backward (weights excluded) while active: `live`
    now and `peak`, the most at once. Each saved storage counts once, until it is freed.

    Trackers nest without hiding each other (autograd applies only the innermost saved-tensor
    hooks): the outermost installs the hooks, and every active tracker sees each saved tensor.
    Activation offload's hooks (`core.shard.offload`) shadow these inside an offloading stage:
    they hand over what they keep on the device, so `peak` is the device's share.
    """

    _active: list[SavedActivations] = []

    def __init__(self) -> None:
        self._live: dict[int, int] = {}  # storage pointer -> bytes
        self._aliases: dict[int, int] = {}  # storage pointer -> saved aliases still held
        self.live = 0
        self.peak = 0
        self._hooks: Any = None
        self._observer: Any = None

    def __enter__(self) -> SavedActivations:
        if not SavedActivations._active:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(_pack_for_all, lambda t: t)
            self._hooks.__enter__()
            self._observer = keep_observer(_pack_for_all)
            self._observer.__enter__()
        SavedActivations._active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        SavedActivations._active.remove(self)
        if self._hooks is not None:
            self._observer.__exit__(*exc)
            self._hooks.__exit__(*exc)
            self._hooks = self._observer = None

    def _saved(self, key: int, nbytes: int, alias: torch.Tensor) -> None:
        if key not in self._live:
            self._live[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._aliases[key] = self._aliases.get(key, 0) + 1
        weakref.finalize(alias, self._release, key)  # autograd drops it with the saved tensor

    def _release(self, key: int) -> None:
        self._aliases[key] -= 1
        if not self._aliases[key]:
            del self._aliases[key]
            self.live -= self._live.pop(key, 0)


def _pack_for_all(tensor: torch.Tensor) -> torch.Tensor:
    # Parameters are saved for backward too; they are weights, not activations.
    base = view_base(tensor)
    if isinstance(tensor, nn.Parameter) or isinstance(base, nn.Parameter):
        return tensor
    local = tensor
    if isinstance(tensor, DTensor):  # tensor parallelism saves DTensors: count their shard
        with torch.no_grad():
            local = tensor.to_local()
    try:
        storage = local.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
    except RuntimeError:  # other wrapper subclasses have no storage of their own
        return tensor
    if not key:
        return tensor
    # Autograd keeps what the hook returns. The tensor itself would keep its grad_fn, and a saved
    # output then holds its own node: a cycle that only running the node breaks. Split backward
    # (I with retain_graph, then W over the weight paths) never runs the nodes of the input path,
    # so their saved tensors leaked for good. A detached alias shares the storage, not the node.
    alias = tensor.detach()
    for tracker in SavedActivations._active:
        tracker._saved(key, nbytes, alias)
    return alias
