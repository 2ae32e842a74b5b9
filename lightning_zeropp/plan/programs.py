"""Each pipeline rank's program for a layout: its tasks in the order the runtime runs them,
flagged where a task gathers a stage's weights (from the shard group or hpZ's in-node copy) and
where it reduces the stage's gradients.

FSDP gathers a stage's units when a task reaches them ungathered, reshards after forward when told
to, and reduces after the stage's last gradient task; ZeroPP follows its lowered plan
(`core.schedule.build.zeropp_plans`). The step-time model (`plan.steptime`) prices these programs
and the traffic count (`plan.comm`) counts them, so both read this module, not each other.
"""

from __future__ import annotations

from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.settings.plus import hpz_size
from lightning_zeropp.plan.orders import schedule_key, task_orders, zeropp_plans
from lightning_zeropp.plan.simulate import Op

__all__ = ["programs_for"]

_PROGRAMS: dict[tuple, dict[int, list[Op]]] = {}


def programs_for(cfg: ZeroPPLayout) -> dict[int, list[Op]]:
    """Each pipeline rank's tasks for a resolved config, flagged where they gather and reduce
    (shared between configs of one schedule: do not modify)."""
    key = schedule_key(cfg)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = _zeropp_programs(cfg) if cfg.schedule == "zeropp" else _programs(cfg)
    return _PROGRAMS[key]


def _programs(cfg: ZeroPPLayout) -> dict[int, list[Op]]:
    programs = {}
    reshard = bool(cfg.reshard_after_forward)
    copy = hpz_size(cfg) is not None
    for rank, order in task_orders(cfg).items():
        last = {stage: i for i, (kind, stage, _) in enumerate(order) if kind in "BW"}
        gathered: set[int] = set()
        in_node: set[int] = set()  # resharded to hpZ's in-node copy
        ops = []
        for i, (kind, stage, mb) in enumerate(order):
            # FSDP gathers a unit that is not gathered when a forward or backward reaches it; it
            # reshards after forward when told to (to hpZ's copy with hpZ), and keeps a
            # backward's weights until the next forward (gradient accumulation): FSDP alone
            # gathers M + 1 times a step.
            gather = kind != "W" and stage not in gathered
            from_node = gather and stage in in_node
            gathered.add(stage)
            in_node.discard(stage)
            if kind == "F" and reshard:
                gathered.discard(stage)
                if copy:
                    in_node.add(stage)
            ops.append(
                Op(kind, stage, mb, gather=gather, reduce=i == last[stage], from_node=from_node)
            )
        programs[rank] = ops
    return programs


def _zeropp_programs(cfg: ZeroPPLayout) -> dict[int, list[Op]]:
    programs = {}
    for rank, plan in zeropp_plans(cfg).items():
        ops: list[Op] = []
        pending: set[int] = set()
        in_node: set[int] = set()  # released to hpZ's in-node copy
        for step in plan:
            if step.kind == "gather":
                pending.add(step.stage)
            elif step.kind == "compute":
                t = step.task
                assert t is not None
                gather = t.stage in pending
                ops.append(
                    Op(t.kind, t.stage, t.microbatch, gather=gather,
                       from_node=gather and t.stage in in_node)
                )  # fmt: skip
                if gather:
                    in_node.discard(t.stage)
                pending.discard(t.stage)
            elif step.kind == "reduce":
                ops[-1] = Op(**{**ops[-1].__dict__, "reduce": True})
            elif step.kind == "release" and step.node_copy:
                in_node.add(step.stage)
        last = {op.stage: i for i, op in enumerate(ops) if op.kind in "BW"}
        for i in last.values():  # the end-of-step reduction
            ops[i] = Op(**{**ops[i].__dict__, "reduce": True})
        programs[rank] = ops
    return programs
