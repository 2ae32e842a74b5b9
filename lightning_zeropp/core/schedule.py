"""Pipeline schedules by name, and where each schedule puts its stages.

Three placement styles cover torch's schedules:
- "single": one stage per rank, stage i on pipeline rank i (GPipe, 1F1B);
- "looped": `num_chunks` stages per rank, rank r holds r, r + pp, r + 2pp, ... (Interleaved1F1B,
  LoopedBFS, InterleavedZeroBubble);
- "v": two stages per rank folded in a V, rank r holds r and 2pp - 1 - r (ZBVZeroBubble, DualPipeV).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch.distributed.pipelining as pipelining

from lightning_zeropp.core.zeropp_schedule import Task, check_orders, rank_order, reduce_points

if TYPE_CHECKING:
    from lightning_zeropp.core.config import ZeroPPConfig

__all__ = [
    "SCHEDULES",
    "schedule_style",
    "stage_ids_for_rank",
    "rank_of_stage",
    "build_schedule",
    "build_eval_schedule",
    "eval_microbatches",
    "zeropp_orders",
]

Style = Literal["single", "looped", "v"]

# name -> (torch schedule class, or None for ZeroPP's own order; placement style)
SCHEDULES: dict[str, tuple[type | None, Style]] = {
    "gpipe": (pipelining.ScheduleGPipe, "single"),
    "1f1b": (pipelining.Schedule1F1B, "single"),
    "interleaved_1f1b": (pipelining.ScheduleInterleaved1F1B, "looped"),
    "looped_bfs": (pipelining.ScheduleLoopedBFS, "looped"),
    "interleaved_zb": (pipelining.ScheduleInterleavedZeroBubble, "looped"),
    "zbv": (pipelining.ScheduleZBVZeroBubble, "v"),
    "dualpipev": (pipelining.ScheduleDualPipeV, "v"),
    # ZeroPP's unit schedule (core.zeropp_schedule), run by torch's runtime: see _build_zeropp.
    "zeropp": (None, "looped"),
}


def schedule_style(name: str) -> Style:
    """Placement style of a schedule name (see module docstring)."""
    return SCHEDULES[name][1]


def stage_ids_for_rank(style: Style, pp_rank: int, pp_size: int, num_chunks: int) -> list[int]:
    """Global stage indices held by pipeline rank `pp_rank`, in execution order."""
    if style == "v":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + c * pp_size for c in range(num_chunks)]


def rank_of_stage(style: Style, stage: int, pp_size: int) -> int:
    """Pipeline rank that holds global stage `stage`."""
    if style == "v" and stage >= pp_size:
        return 2 * pp_size - 1 - stage
    return stage % pp_size


def build_schedule(
    config: ZeroPPConfig,
    stages: list[pipelining.PipelineStage],
    loss_fn: Callable | None,
) -> pipelining.schedules._PipelineSchedule:
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


def zeropp_orders(config: ZeroPPConfig) -> dict[int, list[Task]]:
    """Every pipeline rank's ZeroPP task order for a resolved config (checked: no deadlock)."""
    pp, v, m, u = config.pp_size, config.num_chunks, config.num_microbatches, config.unit_size
    assert pp is not None and v is not None and m is not None and u is not None, "resolve() first"
    full = [s for s in range(config.num_stages) if config.recomputes(s)]
    orders = {
        r: rank_order(
            r, pp, v, m, u, split_backward=bool(config.split_backward), full_backward=full
        )
        for r in range(pp)
    }
    check_orders(orders, config.num_stages, m)  # cheap; a bug here would be a hang
    return orders


def _build_zeropp(
    config: ZeroPPConfig, stages: list[pipelining.PipelineStage], loss_fn: Callable | None
) -> pipelining.schedules._PipelineSchedule:
    from lightning_zeropp.core._torch_private import UnitScheduleRuntime

    orders = zeropp_orders(config)
    assert config.num_microbatches is not None and config.unit_size is not None
    return UnitScheduleRuntime(
        stages,
        config.num_microbatches,
        loss_fn,
        orders,
        reduce_at={
            r: reduce_points(o, config.unit_size, config.grad_reduce) for r, o in orders.items()
        },
        keep_node_copy=config.hpz_partition_size is not None
        and config.hpz_partition_size < (config.dp_shard_size or 1),
    )


def eval_microbatches(rows: int, num_microbatches: int) -> int:
    """Micro-batches for a forward-only batch of `rows`: the most, up to the configured number,
    that split it into equal parts (a short last validation batch of 7 rows runs as one)."""
    return max(d for d in range(1, min(rows, num_microbatches) + 1) if rows % d == 0)


def build_eval_schedule(
    config: ZeroPPConfig,
    stages: list[pipelining.PipelineStage],
    loss_fn: Callable | None,
    num_microbatches: int,
) -> pipelining.schedules._PipelineSchedule:
    """A forward-only schedule for any schedule's placement and any number of micro-batches.

    Each rank runs its stages in order, every micro-batch through one stage before the next
    (breadth first, as GPipe does): no backward to interleave, so no minimum micro-batch count,
    and each stage's weights are gathered once.
    """
    from lightning_zeropp.core._torch_private import UnitScheduleRuntime

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
    return UnitScheduleRuntime(
        stages, num_microbatches, loss_fn, orders, stage_to_rank=mapping, forward_only=True
    )
