"""The ZeroPP plan as data: `schedule.zeropp.lower`, and one lowering read by the runtime and the
pictures (the planner reads `zeropp_plans` too)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_zeropp.core.schedule.build import zeropp_orders, zeropp_plans
from lightning_zeropp.core.schedule.runtime import UnitScheduleRuntime, torch_actions
from lightning_zeropp.core.schedule.zeropp import Step, Task, lower
from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.viz import planned_timelines


def test_lower_wraps_blocks_and_places_early_reductions() -> None:
    f = [Task(0, "F", m) for m in range(2)]
    b = [Task(0, "B", m) for m in range(2)]
    order = [*f, Task(2, "F", 0), Task(2, "B", 0), *b]
    plan = lower(order, reduce_at={4})
    kinds = [(s.kind, s.stage) for s in plan]
    assert kinds == [
        ("gather", 0), ("compute", 0), ("compute", 0), ("release", 0),
        ("gather", 2), ("compute", 2), ("compute", 2), ("release", 2),
        ("gather", 0), ("compute", 0), ("reduce", 0), ("compute", 0), ("release", 0),
    ]  # fmt: skip
    assert plan[10] == Step("reduce", 0, Task(0, "B", 0))
    assert not any(s.node_copy for s in plan)
    # hpZ: only the release after stage 0's forwards keeps the node copy (stage 0 runs again);
    # stage 2's block ends in a backward, and stage 0's last block has no later block.
    kept = [i for i, s in enumerate(lower(order, keep_node_copy=True)) if s.node_copy]
    assert kept == [3]


CONFIGS = [
    {"pp_size": 2, "num_microbatches": 8, "unit_size": 4},
    {"pp_size": 2, "num_microbatches": 6, "grad_reduce": "unit", "num_chunks": 3},
    {"pp_size": 4, "num_microbatches": 8, "dp_shard_size": 4, "hpz_partition_size": 2,
     "node_size": 2},
]  # fmt: skip


def _config(settings: dict) -> ZeroPPConfig:
    world = settings["pp_size"] * settings.get("dp_shard_size", 1)
    return ZeroPPConfig(schedule="zeropp", **settings).resolve(world)


@pytest.mark.parametrize("settings", CONFIGS)
def test_runtime_and_pictures_read_the_one_lowering(settings: dict) -> None:
    config = _config(settings)
    plans = zeropp_plans(config)
    assert any(s.node_copy for p in plans.values() for s in p) == ("hpz_partition_size" in settings)
    # The pictures: one comm interval per gather / release / early reduction, in plan order.
    names = {"gather": "all_gather", "release": "release", "reduce": "reduce_scatter"}
    for tl in planned_timelines(config):
        comm = [i for i in tl.intervals if i.lane == "comm" and i.kind != "send"]
        # A gather is drawn ending where its block starts; a release or reduction starts where
        # its task ended. At one instant the plan's order is: reduce, release, gather.
        rank_of = {"reduce_scatter": 0, "release": 1, "all_gather": 2}
        comm.sort(key=lambda i: (i.end if i.kind == "all_gather" else i.start, rank_of[i.kind]))
        want = [(names[s.kind], s.stage) for s in plans[tl.rank] if s.kind != "compute"]
        assert [(i.kind, i.stage) for i in comm] == want
    # The runtime: its actions (before torch adds sends, receives and the end-of-step
    # reduction) are the plans' steps, one for one.
    for rank, plan in plans.items():
        runtime = UnitScheduleRuntime(_stages(config, rank), config.num_microbatches, None, plans)
        assert runtime.plans[rank] == plan
        added = {"SEND_F", "SEND_B", "RECV_F", "RECV_B"}
        ran = [
            str(a)
            for a in runtime.pipeline_order_with_comms[rank]
            if not any(k in str(a) for k in added) and str(a) != f"{a.stage_index}REDUCE_GRAD"
        ]
        assert ran == [str(a) for a in torch_actions(plan)]
        assert [t for s in plan if (t := s.task) and s.kind == "compute"] == zeropp_orders(config)[
            rank
        ]


def _stages(config: ZeroPPConfig, rank: int) -> list[SimpleNamespace]:
    """What the runtime's constructor reads of this rank's stages."""
    ids = range(rank, config.num_stages, config.pp_size)
    return [
        SimpleNamespace(
            stage_index=s,
            num_stages=config.num_stages,
            group_rank=rank,
            group_size=config.pp_size,
            stage_index_to_group_rank={},
            has_backward=True,
            is_first=s == 0,
            is_last=s == config.num_stages - 1,
        )  # fmt: skip
        for s in ids
    ]


def test_the_config_and_the_plan_import_no_schedule_or_runtime() -> None:
    """One-way: the config side (names, placement, ZeRO++ settings) and the plan as data import
    nothing of torch's schedules or of the runtime that executes them (read from their sources:
    importing any submodule runs the package's __init__, which imports everything)."""
    import ast
    from pathlib import Path

    core = Path(__file__).resolve().parents[2] / "lightning_zeropp" / "core"
    banned = (
        "lightning_zeropp.core.schedule.build",
        "lightning_zeropp.core.schedule.runtime",
        "torch",
    )
    for name in ("settings/config", "settings/placement", "settings/plus", "schedule/zeropp"):
        tree = ast.parse((core / f"{name}.py").read_text())
        imported = [
            node.module if isinstance(node, ast.ImportFrom) else alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        ]
        bad = [m for m in imported if m and m.startswith(banned) and m != "torch"]
        assert not bad, f"core/{name}.py imports {bad}"


@pytest.mark.parametrize("settings", CONFIGS)
def test_the_planners_lowering_is_the_runtimes(settings: dict) -> None:
    # the planner lowers without re-checking the orders for deadlocks: the same plans
    from lightning_zeropp.plan.orders import _lowered

    for extra in ({}, {"split_backward": False}, {"grad_reduce": "microbatch"}):
        config = _config({**settings, **extra})
        assert _lowered(config) == zeropp_plans(config)
