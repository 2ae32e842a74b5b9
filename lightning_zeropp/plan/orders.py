"""Every pipeline rank's compute tasks in the order its schedule runs them: torch's schedules'
own `pipeline_order` (planned once per shape), GPipe's and 1F1B's as their `_step_microbatches`
runs them, and ZeroPP's lowered plans (`core.schedule.zeropp`). The planner replays these orders
for activation memory (`plan.activations`), programs and step time (`plan.programs`,
`plan.simulate`).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.settings.placement import stage_ids_for_rank

__all__ = ["Order", "schedule_key", "task_orders", "zeropp_plans"]

Order = list[tuple[str, int, int]]  # (kind F/B/I/W, stage, micro-batch)


def schedule_key(config: ZeroPPLayout) -> tuple:
    """What a resolved config's task orders and lowered plans depend on (a search prices many
    layouts that share them: the data-parallel sizes do not change them, but hpZ does)."""
    from lightning_zeropp.core.settings.plus import hpz_size

    return (
        config.schedule, config.pp_size, config.num_chunks, config.num_microbatches,
        config.unit_size, config.split_backward, config.activation_checkpointing,
        tuple(config.recompute_ranks or ()),
        config.grad_reduce, config.reshard_after_forward, hpz_size(config),
    )  # fmt: skip


_ZEROPP: dict[tuple, tuple[dict[int, list[Any]], dict[int, Order]]] = {}


def zeropp_plans(config: ZeroPPLayout) -> dict[int, list[Any]]:
    """`core.schedule.zeropp_plans` of a resolved config, shared by the configs of one schedule
    (do not modify)."""
    return _zeropp(config)[0]


def _zeropp(config: ZeroPPLayout) -> tuple[dict[int, list[Any]], dict[int, Order]]:
    key = schedule_key(config)
    if key not in _ZEROPP:
        plans = _lowered(config)
        orders = {
            r: [(s.task.kind, s.task.stage, s.task.microbatch) for s in plan if s.kind == "compute"]
            for r, plan in plans.items()
        }
        _ZEROPP[key] = (plans, orders)
    return _ZEROPP[key]


def _lowered(config: ZeroPPLayout) -> dict[int, list[Any]]:
    """`core.schedule.build.zeropp_plans` without its deadlock check of the orders (a replay of
    every rank's tasks: most of a search's time, and `simulate` replays them anyway, raising on
    a deadlock); tests/unit/test_plan.py holds the two equal."""
    from lightning_zeropp.core.schedule.zeropp import lower, rank_order, reduce_points
    from lightning_zeropp.core.settings.plus import hpz_size

    pp, v, m, u = config.pp_size, config.num_chunks, config.num_microbatches, config.unit_size
    assert pp is not None and v is not None and m is not None and u is not None
    full = [s for s in range(config.num_stages) if config.recomputes(s)]
    plans = {}
    for r in range(pp):
        order = rank_order(
            r, pp, v, m, u, split_backward=bool(config.split_backward), full_backward=full
        )
        plans[r] = lower(
            order,
            reduce_points(order, u, config.grad_reduce),
            keep_node_copy=hpz_size(config) is not None,
        )
    return plans


def task_orders(config: ZeroPPLayout) -> dict[int, Order]:
    """Every pipeline rank's compute tasks in order, as its schedule runs them (shared: do not
    modify)."""
    if config.schedule == "zeropp":
        return _zeropp(config)[1]
    from lightning_zeropp.core.schedule.build import SCHEDULES

    cls, style = SCHEDULES[config.schedule]
    assert cls is not None
    if style == "single":
        return {r: _single_stage_order(config, r) for r in range(config.pp_size)}
    return _multi_stage_orders(
        config.schedule, config.pp_size, config.num_chunks, config.num_microbatches
    )


@functools.lru_cache(maxsize=256)  # torch plans every rank's order at construction: slow at scale
def _multi_stage_orders(schedule: str, pp: int, v: int, m: int) -> dict[int, Order]:
    from lightning_zeropp.core.schedule.build import SCHEDULES

    cls, style = SCHEDULES[schedule]
    assert cls is not None
    stand_in = ZeroPPConfig(
        pp_size=pp, num_chunks=v, num_microbatches=m, schedule=schedule, node_size=pp
    ).resolve(pp)  # node_size given: not the launcher's LOCAL_WORLD_SIZE
    stages = [_stand_in(s, 0, stand_in) for s in stage_ids_for_rank(style, 0, pp, v)]
    order = cls(stages, m).pipeline_order  # every rank's, planned by rank 0's instance
    return {
        rank: [
            (a.computation_type.value, a.stage_index, a.microbatch_index)
            for action in order[rank]
            if action is not None
            # DualPipeV pairs a forward and a backward (OVERLAP_F_B); torch runs them in turn
            for a in (getattr(action, "sub_actions", None) or (action,))
            if a.computation_type.value in ("F", "B", "I", "W")
        ]
        for rank in range(pp)
    }


def _single_stage_order(config: ZeroPPLayout, rank: int) -> Order:
    """GPipe's and 1F1B's order as their `_step_microbatches` runs it (their `pipeline_order` is
    only a drawing, and 1F1B's numbers the last rank's micro-batches from 1)."""
    m = config.num_microbatches
    if config.schedule == "gpipe":
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    warmup = min(m, config.pp_size - rank)  # torch's 1F1B: one more than the textbook's
    order: Order = [("F", rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("B", rank, i), ("F", rank, warmup + i)]
    return order + [("B", rank, i) for i in range(m - warmup, m)]


def _stand_in(stage: int, rank: int, config: ZeroPPLayout) -> SimpleNamespace:
    """What a torch schedule's constructor reads of a stage to plan its order."""
    n = config.num_stages
    return SimpleNamespace(
        stage_index=stage, num_stages=n, group_rank=rank, group_size=config.pp_size,
        stage_index_to_group_rank={}, has_backward=True, is_first=stage == 0,
        is_last=stage == n - 1, submod=None,
    )  # fmt: skip
