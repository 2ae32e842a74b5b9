"""Pipeline schedules by name: torch's schedule classes and ZeroPP's unit schedule, built over a
rank's stages (placements: `core.settings.placement`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed.pipelining as pipelining

from lightning_zeropp.core._torch_private import PipelineSchedule
from lightning_zeropp.core.schedule.zeropp import (
    Step,
    Task,
    check_orders,
    lower,
    rank_order,
    reduce_points,
)
from lightning_zeropp.core.settings.placement import (
    SCHEDULE_ROWS,
    Style,
    rank_of_stage,
    schedule_style,
    stage_ids_for_rank,
)
from lightning_zeropp.core.settings.plus import hpz_size

if TYPE_CHECKING:
    from lightning_zeropp.core.settings.layout import ZeroPPLayout

__all__ = [
    "SCHEDULES",
    "build_schedule",
    "build_eval_schedule",
    "eval_microbatches",
    "zeropp_orders",
    "zeropp_plans",
]

# name -> (torch schedule class, or None for ZeroPP's own order; placement style), from the one
# table of schedules (core.settings.placement), each class found by its name in torch
SCHEDULES: dict[str, tuple[type | None, Style]] = {
    row.name: (getattr(pipelining, row.torch_class) if row.torch_class else None, row.style)
    for row in SCHEDULE_ROWS
}


def build_schedule(
    config: ZeroPPLayout,
    stages: list[pipelining.PipelineStage],
    loss_fn: Callable | None,
) -> PipelineSchedule:
    """Instantiate the (resolved) config's schedule over this rank's stages.

    Losses are per-micro-batch means and the schedule divides gradients by the micro-batch count
    (`scale_grads=True`), so gradients are the mean over the rank's batch; FSDP then averages over
    data-parallel ranks, giving the mean over the global batch.
    """
    if config.schedule == "zeropp":
        return _build_zeropp(config, stages, loss_fn)
    cls, style = SCHEDULES[config.schedule]
    assert cls is not None
    target = stages[0] if style == "single" else stages
    return cls(target, n_microbatches=config.num_microbatches, loss_fn=loss_fn, scale_grads=True)


def zeropp_orders(config: ZeroPPLayout) -> dict[int, list[Task]]:
    """Every pipeline rank's ZeroPP task order for a resolved config (checked: no deadlock)."""
    pp, v, m, u = config.pp_size, config.num_chunks, config.num_microbatches, config.unit_size
    assert u is not None, "a zeropp layout has a unit size"
    full = [s for s in range(config.num_stages) if config.recomputes(s)]
    orders = {
        r: rank_order(r, pp, v, m, u, split_backward=config.split_backward, full_backward=full)
        for r in range(pp)
    }
    check_orders(orders, config.num_stages, m)  # cheap; a bug here would be a hang
    return orders


def _build_zeropp(
    config: ZeroPPLayout, stages: list[pipelining.PipelineStage], loss_fn: Callable | None
) -> PipelineSchedule:
    from lightning_zeropp.core.schedule.runtime import UnitScheduleRuntime

    return UnitScheduleRuntime(stages, config.num_microbatches, loss_fn, zeropp_plans(config))


def zeropp_plans(config: ZeroPPLayout) -> dict[int, list[Step]]:
    """Every pipeline rank's lowered ZeroPP plan (`schedule.zeropp.lower`): what the runtime
    runs, the pictures draw and the planner prices."""
    assert config.unit_size is not None, "a zeropp layout has a unit size"
    return {
        rank: lower(
            order,
            reduce_points(order, config.unit_size, config.grad_reduce),
            keep_node_copy=hpz_size(config) is not None,
        )
        for rank, order in zeropp_orders(config).items()
    }


def eval_microbatches(rows: int, num_microbatches: int) -> int:
    """Micro-batches for a forward-only batch of `rows`: the most, up to the configured number,
    that split it into equal parts (a short last validation batch of 7 rows runs as one)."""
    return max(d for d in range(1, min(rows, num_microbatches) + 1) if rows % d == 0)


def build_eval_schedule(
    config: ZeroPPLayout,
    stages: list[pipelining.PipelineStage],
    loss_fn: Callable | None,
    num_microbatches: int,
) -> PipelineSchedule:
    """A forward-only schedule for any schedule's placement and any number of micro-batches.

    Each rank runs its stages in order, every micro-batch through one stage before the next
    (breadth first, as GPipe does): no backward to interleave, so no minimum micro-batch count,
    and each stage's weights are gathered once.
    """
    from lightning_zeropp.core.schedule.runtime import UnitScheduleRuntime

    assert config.pp_size is not None and config.num_chunks is not None, "resolve() first"
    style = schedule_style(config.schedule)
    orders = {
        r: [
            Task(s, "F", m)
            for s in sorted(stage_ids_for_rank(style, r, config.pp_size, config.num_chunks))
            for m in range(num_microbatches)
        ]
        for r in range(config.pp_size)
    }
    mapping = {s: rank_of_stage(style, s, config.pp_size) for s in range(config.num_stages)}
    plans = {rank: lower(order) for rank, order in orders.items()}
    return UnitScheduleRuntime(
        stages, num_microbatches, loss_fn, plans, stage_to_rank=mapping, forward_only=True
    )
