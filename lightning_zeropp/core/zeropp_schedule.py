"""The ZeroPP unit schedule: per-rank task order, chunk gather blocks, and a dependency check.

Pure Python (no torch): the runtime that executes these orders lives in `_torch_private`.

Each pipeline rank r holds v chunks, stages r, r + pp, ..., r + (v-1)pp. A step's M micro-batches are
cut into units of U (the last may be smaller) that run back to back, each filling and draining the
pipeline. Inside a unit of size u on rank r:
- forward micro-step k runs chunk k // u on micro-batch k % u: all u micro-batches through chunk 0,
  then chunk 1, ...; backward runs chunk v-1 first, then v-2, ...;
- warm-up: min(2(pp - r - 1) + (v - 1)u, uv) forwards; steady phase: one forward, one backward
  (both on the last chunk); cool-down: the remaining backwards.
So each chunk's tasks come in contiguous blocks: 0, 1, ..., v-1 (forward and backward together),
v-2, ..., 0. A chunk's weights are gathered once per block, 2v - 1 gathers per unit whatever u is,
instead of once per micro-batch; blocks that meet across a unit boundary share a gather.

Backward is a full backward for now (input and weight gradients together).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["Task", "units", "rank_order", "gather_blocks", "check_orders"]

Kind = Literal["F", "B"]


@dataclass(frozen=True)
class Task:
    """One compute task: forward ("F") or full backward ("B") of a stage on a micro-batch."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def units(num_microbatches: int, unit_size: int) -> list[range]:
    """Micro-batch indices of each unit; the last unit holds what is left."""
    return [
        range(s, min(s + unit_size, num_microbatches))
        for s in range(0, num_microbatches, unit_size)
    ]


def rank_order(
    rank: int, pp_size: int, num_chunks: int, num_microbatches: int, unit_size: int
) -> list[Task]:
    """The tasks of pipeline rank `rank`, in execution order, for one step."""
    order: list[Task] = []
    for unit in units(num_microbatches, unit_size):
        order += _unit_order(rank, pp_size, num_chunks, unit)
    return order


def _unit_order(rank: int, pp: int, v: int, unit: range) -> list[Task]:
    u = len(unit)
    fwd = [Task(rank + (k // u) * pp, "F", unit[k % u]) for k in range(u * v)]
    bwd = [Task(rank + (v - 1 - k // u) * pp, "B", unit[k % u]) for k in range(u * v)]
    warmup = min(2 * (pp - rank - 1) + (v - 1) * u, u * v)
    order = fwd[:warmup]
    steady = len(fwd) - warmup
    for i in range(steady):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[steady:]


def gather_blocks(order: Sequence[Task]) -> list[tuple[int, int, int]]:
    """(stage, first index, end index) of each maximal run of one stage's tasks in `order`.

    One gather (UNSHARD) goes before each run and one release (RESHARD) after it.
    """
    blocks: list[tuple[int, int, int]] = []
    for i, task in enumerate(order):
        if blocks and blocks[-1][0] == task.stage:
            blocks[-1] = (task.stage, blocks[-1][1], i + 1)
        else:
            blocks.append((task.stage, i, i + 1))
    return blocks


def check_orders(orders: dict[int, list[Task]], num_stages: int, num_microbatches: int) -> None:
    """Run the ranks' orders against each other; raise if a task would wait forever.

    Model: a rank runs its tasks in order; a task starts once its inputs exist (sends never block).
    F(s, m) needs F(s-1, m); B(s, m) needs F(s, m) and B(s+1, m). Every stage must do F and B once
    per micro-batch.
    """
    want = {
        Task(s, k, m)
        for s in range(num_stages)
        for k in ("F", "B")
        for m in range(num_microbatches)
    }
    got = [t for order in orders.values() for t in order]
    if sorted(map(str, got)) != sorted(map(str, want)):
        raise ValueError("the orders do not run every stage's F and B exactly once per micro-batch")
    done: set[Task] = set()
    cursor = dict.fromkeys(orders, 0)
    while len(done) < len(want):
        progressed = False
        for rank, order in orders.items():
            while cursor[rank] < len(order) and _ready(order[cursor[rank]], done, num_stages):
                done.add(order[cursor[rank]])
                cursor[rank] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(o[cursor[r]]) for r, o in orders.items() if cursor[r] < len(o)}
            raise ValueError(f"the schedule deadlocks; next task per rank: {stuck}")


def _ready(task: Task, done: set[Task], num_stages: int) -> bool:
    if task.kind == "F":
        return task.stage == 0 or Task(task.stage - 1, "F", task.microbatch) in done
    own_forward = Task(task.stage, "F", task.microbatch) in done
    last = task.stage == num_stages - 1
    return own_forward and (last or Task(task.stage + 1, "B", task.microbatch) in done)
