"""Step time per layout, predicted: what each stage's micro-batch costs (`plan.stage_costs`: FLOPs
and bytes from the model on the meta device, rates from `Hardware`), the schedule's own programs
replayed by `plan.simulate` over those costs, and the optimizer step.

- Which task gathers and which reduces: `plan.comm`'s counts, placed where the runtime does them
  (`plan.programs.programs_for`: FSDP gathers a stage's units when a task reaches them ungathered, reshards
  after forward when told to, and reduces after the stage's last gradient task; ZeroPP follows
  its lowered plan, `core.schedule.build.zeropp_plans`).
- The optimizer step updates each rank's shard at `Hardware.optimizer_rate` (by default AdamW
  streaming its state once: 28 bytes per fp32 parameter).
- `price` computes a layout's costs (`Priced`) without simulating them, so a search can skip a
  layout whose `lower_bound` is already beaten; `predict_range` is the slow and the fast end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.plan.cut import settle
from lightning_zeropp.plan.hardware import Hardware, compile_mode
from lightning_zeropp.plan.memory import predict_memory
from lightning_zeropp.plan.programs import programs_for
from lightning_zeropp.plan.simulate import RankTimeline, StageCost, compute_seconds, simulate
from lightning_zeropp.plan.stage_costs import stage_costs

__all__ = [
    "StepTimePlan",
    "optimizer_time",
    "Priced",
    "predict_range",
    "price",
    "predict_step_time",
]


@dataclass(frozen=True)
class StepTimePlan:
    """A predicted training step."""

    step_s: float
    optimizer_s: float
    ranks: dict[int, RankTimeline]  # by pipeline rank
    model_flops: float  # forward + backward FLOPs of the whole global batch (no recompute)
    world_size: int
    peak_flops_per_s: float

    @property
    def bubble(self) -> float:
        """Largest fraction of the step (before the optimizer) a rank's compute lane is idle:
        the pipeline bubble plus exposed communication."""
        end = max(line.end for line in self.ranks.values())
        return max(1.0 - line.compute / end for line in self.ranks.values()) if end else 0.0

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_s * self.world_size * self.peak_flops_per_s)


def predict_step_time(
    model: nn.Module,
    config: ZeroPPConfig | ZeroPPLayout,
    world_size: int,
    global_batch: int,
    seq_len: int,
    hardware: Hardware,
    *,
    stage_seconds: Sequence[tuple[float, float]] | None = None,
    unit_seconds: Sequence[Sequence[tuple[float, float]]] | None = None,
    optimizer_seconds: float | None = None,
    optimizer: str = "adamw",
    compiled: bool | None = None,
    bound: str = "mid",
) -> StepTimePlan:
    """Predict one training step of `model` (meta device) under `config` on `hardware`.

    `stage_seconds`: measured (forward, backward) seconds of one micro-batch per stage, to use
    instead of FLOPs / `hardware.flops_per_s`; `unit_seconds`: the same per stage and FSDP unit
    (the stage's own part first, then its blocks), e.g. an emulated device's; `optimizer_seconds`:
    a measured optimizer step, instead of the shard at `hardware.optimizer_rate`.

    `compiled` (default: the config's `compile`): the blocks are compiled, whole, or in regions
    under split backward (`hardware.compile_mode`); the rate is that mode's share of peak, at
    `bound` ("low", "mid", "high") of the hardware's efficiency range
    (`Hardware.at`; a hardware without a range has one rate)."""
    return price(
        model, config, world_size, global_batch, seq_len, hardware,
        stage_seconds=stage_seconds, unit_seconds=unit_seconds,
        optimizer_seconds=optimizer_seconds, optimizer=optimizer, compiled=compiled, bound=bound,
    ).plan()  # fmt: skip


@dataclass(frozen=True)
class Priced:
    """A layout's costs, before its step is simulated (`plan`); `lower_bound` is what no
    simulation of them can beat, which lets a search skip simulating hopeless layouts."""

    cfg: ZeroPPLayout
    costs: list[StageCost]
    where: dict[int, int]
    flops: list[list[float]]
    optimizer_s: float
    hardware: Hardware
    world_size: int

    def lower_bound(self) -> float:
        """The busiest rank's compute alone, plus the optimizer (a rank's compute lane runs its
        tasks one at a time, so its step is at least their sum)."""
        busiest = max(compute_seconds(programs_for(self.cfg), self.costs).values())
        return busiest + self.optimizer_s

    def plan(self) -> StepTimePlan:
        lines = simulate(programs_for(self.cfg), self.costs, self.where, self.hardware.overlap)
        cfg, hw = self.cfg, self.hardware
        ranks = cfg.dp_size * cfg.cp_size  # each CP rank computes its part of the rows
        total_forward = sum(map(sum, self.flops)) * cfg.num_microbatches * ranks
        return StepTimePlan(
            step_s=max(line.end for line in lines.values()) + self.optimizer_s,
            optimizer_s=self.optimizer_s,
            ranks=lines,
            model_flops=3.0 * total_forward,
            world_size=self.world_size,
            peak_flops_per_s=hw.peak_flops_per_s or hw.flops_per_s,
        )


def price(
    model: nn.Module,
    config: ZeroPPConfig | ZeroPPLayout,
    world_size: int,
    global_batch: int,
    seq_len: int,
    hardware: Hardware,
    *,
    stage_seconds: Sequence[tuple[float, float]] | None = None,
    unit_seconds: Sequence[Sequence[tuple[float, float]]] | None = None,
    optimizer_seconds: float | None = None,
    optimizer: str = "adamw",
    compiled: bool | None = None,
    bound: str = "mid",
) -> Priced:
    """`predict_step_time`'s costs, not yet simulated (its arguments)."""
    if stage_seconds is None and unit_seconds is None:  # measured: the caller's stages as given
        config = settle(model, config, seq_len, world_size)  # no split points: the engine's cut
    cfg = config.resolve(world_size)
    hardware = hardware.at(compile_mode(cfg, compiled), bound)
    costs, where, flops = stage_costs(
        model, cfg, global_batch, seq_len, hardware, stage_seconds, unit_seconds
    )
    optimizer_s = (
        optimizer_seconds
        if optimizer_seconds is not None
        else optimizer_time(model, cfg, world_size, hardware, optimizer)
    )
    return Priced(cfg, costs, where, flops, optimizer_s, hardware, world_size)


def predict_range(
    model: nn.Module,
    config: ZeroPPConfig | ZeroPPLayout,
    world_size: int,
    global_batch: int,
    seq_len: int,
    hardware: Hardware,
    **kwargs: Any,
) -> tuple[StepTimePlan, StepTimePlan]:
    """The slow and the fast end of a prediction: `predict_step_time` at the low and the high
    end of the hardware's efficiency range (the same plan twice without one)."""
    slow, fast = (
        predict_step_time(
            model, config, world_size, global_batch, seq_len, hardware, bound=bound, **kwargs
        )
        for bound in ("low", "high")
    )
    return slow, fast


def optimizer_time(
    model: nn.Module, cfg: ZeroPPLayout, world_size: int, hardware: Hardware, optimizer: str
) -> float:
    """Seconds of the optimizer step: the largest shard at `hardware.optimizer_rate`."""
    memory = predict_memory(model, cfg, world_size, optimizer)
    return max(m.parameters for m in memory) / hardware.optimizer_rate
