"""What `ZeroPPEngine` reports besides the loss: the last step's collectives as metrics, and
memory (bytes held per rank, the first step's measured peaks), from `core.measure`.

The engine holds one `EngineReports` (`engine.reports`), built over its mesh, device and stages,
and its training step records into it (the collectives counted, the first step's peaks); the
engine's own report methods and properties hand over to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_zeropp.core.measure.axes import flatten_summary, mesh_axis_namer
from lightning_zeropp.core.measure.comm import PLUS_AXES, CommCounter
from lightning_zeropp.core.measure.memory import (
    GatheredPeak,
    SavedActivations,
    format_report,
    measure,
)
from lightning_zeropp.core.mesh import ParallelDims
from lightning_zeropp.core.shard.offload import OffloadStats

__all__ = ["EngineReports", "StepMeasures"]


class EngineReports:
    """`ZeroPPEngine`'s reports over this rank's stages (`module`) on `dims`' mesh.

    `offload`: the bytes the activation offload moved (None: this rank does not offload);
    `count_comms`: the engine counts every training step's collectives into `last_comms`."""

    def __init__(
        self,
        dims: ParallelDims,
        device: torch.device,
        module: nn.Module,
        offload: OffloadStats | None,
        count_comms: bool,
    ) -> None:
        self.dims, self.device, self.module, self.offload = dims, device, module, offload
        self.count_comms = count_comms
        # {kind: {axis: {"count", "bytes"}}} of the last train_step, when count_comms is on
        self.last_comms: dict[str, dict[str, dict[str, int]]] | None = None
        # The most unsharded weight bytes held at once, and the most bytes saved for backward
        # at once (weights excluded), in the first training step (None before it).
        self.gathered_peak: int | None = None
        self.activation_peak: int | None = None
        self._axis_namer = mesh_axis_namer(dims.mesh)

    def step_measures(self, stages: Sequence[nn.Module]) -> StepMeasures:
        """What one training step over `stages` measures: its collectives when `count_comms`
        is on, and in the first step the peaks of the memory report; `record` keeps them."""
        counter = CommCounter(self._axis_namer) if self.count_comms else None
        first = self.gathered_peak is None
        return StepMeasures(counter, GatheredPeak(stages) if first else None, first)

    def record(self, measures: StepMeasures) -> None:
        """Keep what a step measured (after it completed)."""
        if measures.gathered is not None and measures.saved is not None:
            self.gathered_peak = measures.gathered.peak
            self.activation_peak = measures.saved.peak
        if measures.counter is not None:
            self.last_comms = measures.counter.summary()

    def comm_metrics(self, prefix: str = "comm") -> dict[str, float]:
        """The last training step's collectives as flat metrics, averaged over every rank.

        Keys are `{prefix}/{kind}/{axis}/count` and `.../bytes` (kinds: all_gather,
        reduce_scatter, all_reduce, broadcast, all_to_all, send and recv for point-to-point, ...;
        axes: the mesh's, "world", or ZeRO++'s `PLUS_AXES`), per rank and step; kinds and axes that never occur on any
        rank are left out. Collective: every rank must call it. Needs `count_comms=True`.
        """
        if not self.count_comms or self.last_comms is None:
            raise RuntimeError("comm_metrics needs count_comms=True and one train_step first")
        axes = [*(self.dims.mesh.mesh_dim_names or ()), "world", *PLUS_AXES, "other"]
        flat = flatten_summary(self.last_comms, axes, prefix)
        values = torch.tensor(list(flat.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(values)  # outside the counter: not part of any step's traffic
        values /= dist.get_world_size()
        return {k: float(v) for k, v in zip(flat, values.tolist(), strict=True) if v}

    @property
    def host_activation_peak(self) -> int | None:
        """The most saved-activation bytes this rank held in host memory at once so far (an
        offloading rank; None otherwise): what `activation_peak` no longer counts."""
        return None if self.offload is None else self.offload.peak

    def memory_report(
        self, optimizers: Sequence[torch.optim.Optimizer] = (), title: str = "now"
    ) -> str:
        """Collective: every rank's parameter, gradient and optimizer-state bytes and measured
        peaks (`core.measure.memory`), one line per rank, the same text on every rank."""
        mine = measure(
            self.module,
            optimizers,
            self.device,
            self.gathered_peak,
            self.activation_peak,
            self.host_activation_peak,
        )
        return format_report(mine, title)

    def report_memory_after_first_update(
        self, optimizers: Sequence[torch.optim.Optimizer], emit: Callable[[str], None]
    ) -> None:
        """Call `emit(memory_report(...))` once, right after the first optimizer step (when
        the optimizer state exists); every rank steps its optimizers together."""
        handles: list[Any] = []

        def after_step(*_: Any) -> None:
            for handle in handles:
                handle.remove()
            emit(self.memory_report(optimizers, "after the first update"))

        handles.extend(opt.register_step_post_hook(after_step) for opt in optimizers)


class StepMeasures(contextlib.ExitStack):
    """The measures one training step runs under (entered around the step, in this order):
    the collectives counted (`counter`), and in the first step (`first`) the gathered-weight
    and saved-activation peaks (`gathered`, `saved`)."""

    def __init__(
        self, counter: CommCounter | None, gathered: GatheredPeak | None, first: bool
    ) -> None:
        super().__init__()
        self.counter, self.gathered, self.first = counter, gathered, first
        self.saved = SavedActivations() if first else None

    def __enter__(self) -> StepMeasures:
        super().__enter__()
        for part in (self.counter, self.gathered, self.saved):
            if part is not None:
                self.enter_context(part)
        return self
