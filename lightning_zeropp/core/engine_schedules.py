"""The engine's pipeline schedules: one per (mode, micro-batches, input shapes), built on first use
after the batch checks, agreed on by every rank.

Each schedule fixes its stages' buffer shapes when first run, so a batch of new shapes gets its
own, and the least recently used one goes when `MAX_SCHEDULES` are kept (`ZeroPPEngine` runs
them; `core.schedule.build` builds them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lightning_zeropp.core._torch_private import on_scheduled_loss
from lightning_zeropp.core.measure.planning import PlanningStats
from lightning_zeropp.core.mesh import ParallelDims
from lightning_zeropp.core.schedule.build import build_eval_schedule, build_schedule
from lightning_zeropp.core.schedule.runtime import LeanStage
from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.step.batch import (
    ShapeGuard,
    agree_on_step,
    check_batch,
    shape_key,
    step_microbatches,
)
from lightning_zeropp.core.step.failure import FailureBoard
from lightning_zeropp.core.step.loss import StepLoss

__all__ = ["MAX_SCHEDULES", "Schedules"]

MAX_SCHEDULES = 8

Entry = tuple[Any, list[PipelineStage]]  # a schedule and the stages it runs


class Schedules:
    """This rank's schedules over its stage modules, keyed by what fixes their buffers."""

    def __init__(
        self,
        config: ZeroPPLayout,
        dims: ParallelDims,
        stage_ids: Sequence[int],
        stage_modules: Sequence[nn.Module],
        device: torch.device,
        failures: FailureBoard,
        loss: StepLoss,
        planning: PlanningStats,
        shapes: ShapeGuard | None = None,
    ) -> None:
        self.config, self.dims, self.device = config, dims, device
        self.stage_ids, self.stage_modules = list(stage_ids), list(stage_modules)
        self.failures, self.loss, self.planning, self.shapes = failures, loss, planning, shapes
        self._entries: dict[tuple[Any, ...], Entry] = {}  # most recently used last
        self.inference_context: Any = None  # what shape inference runs in (`ContextAttention`)

    def for_batch(
        self,
        mode: str,
        args: Any,
        kwargs: Any,
        target: Any,
        skip: bool = False,
        chosen: int | None = None,
        problem: ValueError | None = None,
    ) -> Entry | None:
        """The schedule for this batch's shapes (and its stages), after the batch checks.

        A new schedule infers its stages' shapes with a forward that gathers the FSDP-sharded
        weights over the data-parallel ranks, so every rank must build one when any does:
        data-parallel ranks read different batches (padded to different lengths), and a rank
        that found its shapes cached would skip the gathers the others wait on. One small
        all-reduce per step decides it, and stops every rank when one rank's batch fails its
        checks (`agree_on_step`). None when the step is skipped (on every rank). `problem`: the
        batch already found bad (context parallelism's split), stopping every rank alike.
        """
        microbatches, key, popped = 0, None, None
        if not skip and problem is None:
            try:  # this rank's own checks, before any communication
                rows = check_batch(mode, args, kwargs, target, self.shapes)
                microbatches = self.config.num_microbatches  # the key if the next check fails
                microbatches = step_microbatches(mode, rows, microbatches, chosen)
            except ValueError as err:
                problem = err
            key = (mode, microbatches, shape_key((args, kwargs, target)))
            popped = self._entries.pop(key, None)
        entry, skipped = popped, skip
        if self.config.world_size > 1:  # SIGTERM on any rank stops every rank (`agree_on_step`)
            cached, skipped = agree_on_step(
                entry is not None,
                problem,
                self.failures.description,
                self.device,
                self.failures.guard,
                skip,
            )
            entry = entry if cached else None
        elif problem is not None:  # every rank has this batch: each raises this itself
            raise problem
        if skipped:
            if popped is not None and key is not None:  # popped only under a key
                self._entries[key] = popped
            return None
        if entry is None:
            if len(self._entries) >= MAX_SCHEDULES:
                self._entries.pop(next(iter(self._entries)))
                self.planning.evicted(MAX_SCHEDULES)
            entry = self._build(mode, microbatches)
        assert key is not None  # a step without a key (skip=True) is skipped above
        self._entries[key] = entry
        return entry

    def _build(self, mode: str, microbatches: int) -> Entry:
        """A schedule over fresh stages, whose first step infers their shapes (timed in
        `planning`, with the building)."""
        with self.planning.timed():
            stages: list[PipelineStage] = []
            for s, m in zip(self.stage_ids, self.stage_modules, strict=True):
                stage = LeanStage(
                    m, s, self.config.num_stages, self.device, group=self.dims.pp_group
                )
                stage.inference_clock = self.planning
                stage.inference_context = self.inference_context
                stages.append(stage)
            if mode == "train":
                schedule = build_schedule(self.config, stages, self.loss)
            else:
                schedule = build_eval_schedule(self.config, stages, self.loss, microbatches)
            on_scheduled_loss(schedule, self.loss.scheduled)
        self.planning.built()
        return schedule, stages
