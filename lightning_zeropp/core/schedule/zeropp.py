"""The ZeroPP unit schedule: per-rank task order, chunk gather blocks, and a dependency simulator.

Pure Python (no torch). The plan as data: `rank_order` gives a rank's compute tasks, `lower` adds
the gathers, releases and early gradient reductions around them; the runtime (`core.unit_runtime`),
the pictures (`viz`) and the planner all read that one lowering.

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

Split backward: a backward is an input-gradient task I (what the previous stage waits for) and a
weight-gradient task W (which only this rank needs). W runs right after its I, except that in the
steady phase rank r holds back its first 2r + 1 W's of the last chunk and runs them, last held
first, at the end of the unit, where rank r would otherwise wait about 2r task-times for the next
unit's first forward. A held-back W runs after its chunk was released: it needs the saved
activations and gradients, not the weights, so it costs no gather. Stages in `full_backward`
(e.g. recomputed ones, whose W would recompute the forward again) keep one full backward B.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_zeropp.core.settings.values import GradReduce

__all__ = [
    "Task",
    "units",
    "rank_order",
    "gather_blocks",
    "reduce_points",
    "Step",
    "lower",
    "simulate",
    "check_orders",
    "bubble_formula",
    "DURATIONS",
]

Kind = Literal["F", "B", "I", "W"]

# Relative task durations for planning pictures and bubble estimates: a backward costs about two
# forwards, split evenly between the input and the weight gradient.
DURATIONS: dict[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Task:
    """One compute task of a stage on a micro-batch: forward F, full backward B, or the input (I)
    and weight (W) halves of a split backward."""

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
    rank: int,
    pp_size: int,
    num_chunks: int,
    num_microbatches: int,
    unit_size: int,
    *,
    split_backward: bool = False,
    full_backward: Collection[int] = (),
) -> list[Task]:
    """The tasks of pipeline rank `rank`, in execution order, for one step.

    With `split_backward`, backwards are I/W pairs (held-back W's as described in the module
    docstring) except on the stages in `full_backward`, which keep a full backward B.
    """
    order: list[Task] = []
    for unit in units(num_microbatches, unit_size):
        order += _unit_order(rank, pp_size, num_chunks, unit, split_backward, set(full_backward))
    return order


def _unit_order(rank: int, pp: int, v: int, unit: range, split: bool, full: set[int]) -> list[Task]:
    u = len(unit)
    fwd = [Task(rank + (k // u) * pp, "F", unit[k % u]) for k in range(u * v)]
    bwd = [(rank + (v - 1 - k // u) * pp, unit[k % u]) for k in range(u * v)]
    warmup = min(2 * (pp - rank - 1) + (v - 1) * u, u * v)
    steady = len(fwd) - warmup
    last_chunk = rank + (v - 1) * pp
    hold = min(2 * rank + 1, steady) if split and last_chunk not in full else 0
    held: list[Task] = []

    def backward(stage: int, mb: int, defer: bool) -> list[Task]:
        if not split or stage in full:
            return [Task(stage, "B", mb)]
        w = Task(stage, "W", mb)
        if defer:
            held.append(w)
            return [Task(stage, "I", mb)]
        return [Task(stage, "I", mb), w]

    order = fwd[:warmup]
    for i in range(steady):
        order += [fwd[warmup + i], *backward(*bwd[i], defer=i < hold)]
    for stage, mb in bwd[steady:]:
        order += backward(stage, mb, defer=False)
    return order + held[::-1]  # LIFO: the last W held back runs first


def gather_blocks(order: Sequence[Task]) -> list[tuple[int, int, int]]:
    """(stage, first index, end index) of each maximal run of one stage's tasks in `order`.

    One gather (UNSHARD) goes before each run and one release (RESHARD) after it. A W of another
    stage inside a run (a held-back W) neither ends the run nor needs that stage gathered.
    """
    blocks: list[tuple[int, int, int]] = []
    for i, task in enumerate(order):
        if blocks and blocks[-1][0] == task.stage:
            blocks[-1] = (task.stage, blocks[-1][1], i + 1)
        elif blocks and task.kind == "W":
            continue
        else:
            blocks.append((task.stage, i, i + 1))
    return blocks


def reduce_points(order: Sequence[Task], unit_size: int, when: GradReduce) -> list[int]:
    """Indices of the tasks after which a stage's gradients are reduce-scattered early.

    "step": none (one reduce-scatter per stage at the end of the step, placed by the runtime);
    "unit": after each stage's last gradient task (B or W) of every unit but the last;
    "microbatch": after every gradient task but each stage's last one of the step.
    """
    if when == "step":
        return []
    grads = [(i, t) for i, t in enumerate(order) if t.kind in ("B", "W")]
    last_of_stage = {t.stage: i for i, t in grads}
    if when == "microbatch":
        return [i for i, t in grads if i != last_of_stage[t.stage]]
    last_in_unit: dict[tuple[int, int], int] = {}
    for i, t in grads:
        last_in_unit[(t.stage, t.microbatch // unit_size)] = i
    return sorted(i for i in last_in_unit.values() if i != last_of_stage[order[i].stage])


@dataclass(frozen=True)
class Step:
    """One action of a rank's lowered plan, in order.

    "gather": all-gather stage `stage`'s weights (FSDP unshard); "compute": run `task`;
    "reduce": reduce-scatter the stage's gradients early, after `task` (its micro-batch); the
    end-of-step reduction is the runtime's own; "release": free the gathered weights, keeping
    hpZ's node copy when `node_copy` (the chunk runs backward later and hpZ is on).
    """

    kind: Literal["gather", "compute", "reduce", "release"]
    stage: int
    task: Task | None = None
    node_copy: bool = False


def lower(
    order: Sequence[Task], reduce_at: Collection[int] = (), keep_node_copy: bool = False
) -> list[Step]:
    """A rank's task order with one gather before each block of a stage's tasks and one release
    after it (`gather_blocks`), and an early reduction after each task index in `reduce_at`
    (`reduce_points`). With `keep_node_copy` (hpZ), a release after a block of forwards only,
    of a stage that has a later block, keeps the node copy for that later (backward) block."""
    blocks = gather_blocks(order)
    starts = {start: stage for stage, start, _ in blocks}
    ends = {end - 1: stage for stage, _, end in blocks}
    to_copy = {
        end - 1
        for n, (stage, start, end) in enumerate(blocks)
        if keep_node_copy
        and all(t.kind == "F" for t in order[start:end])
        and any(later == stage for later, _, _ in blocks[n + 1 :])
    }
    steps: list[Step] = []
    for i, task in enumerate(order):
        if i in starts:
            steps.append(Step("gather", starts[i]))
        steps.append(Step("compute", task.stage, task))
        if i in reduce_at:
            steps.append(Step("reduce", task.stage, task))
        if i in ends:
            steps.append(Step("release", ends[i], node_copy=i in to_copy))
    return steps


def simulate(
    orders: Mapping[int, Sequence[Task]],
    num_stages: int,
    num_microbatches: int,
    durations: Mapping[str, float] = DURATIONS,
) -> dict[int, list[tuple[Task, float, float]]]:
    """Run the ranks' orders against each other; return each rank's (task, start, end) timeline.

    Model: a rank runs its tasks in order, each as soon as its inputs exist (sends never block,
    communication is free). F(s, m) needs F(s-1, m); the backward of (s, m), B or I, needs F(s, m)
    and the backward of (s+1, m); W(s, m) needs I(s, m). Raises `ValueError` if the orders do not
    run every task exactly once or if some task would wait forever (a deadlock).
    """
    _check_complete(orders, num_stages, num_microbatches)
    end: dict[tuple[int, str, int], float] = {}  # (stage, "F" | "I" | "W", mb) -> end time
    timeline: dict[int, list[tuple[Task, float, float]]] = {r: [] for r in orders}
    clock = dict.fromkeys(orders, 0.0)
    cursor = dict.fromkeys(orders, 0)
    remaining = sum(len(o) for o in orders.values())
    while remaining:
        progressed = False
        for rank, order in orders.items():
            while cursor[rank] < len(order):
                task = order[cursor[rank]]
                deps = _deps(task, num_stages)
                if any(d not in end for d in deps):
                    break
                start = max([clock[rank], *(end[d] for d in deps)])
                clock[rank] = start + durations[task.kind]
                for key in _produces(task):
                    end[key] = clock[rank]
                timeline[rank].append((task, start, clock[rank]))
                cursor[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(o[cursor[r]]) for r, o in orders.items() if cursor[r] < len(o)}
            raise ValueError(f"the schedule deadlocks; next task per rank: {stuck}")
    return timeline


def check_orders(
    orders: Mapping[int, Sequence[Task]], num_stages: int, num_microbatches: int
) -> None:
    """Raise `ValueError` if the orders miss a task or deadlock (see `simulate`)."""
    simulate(orders, num_stages, num_microbatches)


def bubble_formula(pp_size: int, num_chunks: int, unit_size: int) -> float:
    """The design's bubble of a unit without the split backward: (pp-1) / (v*U + pp-1)."""
    return (pp_size - 1) / (num_chunks * unit_size + pp_size - 1)


def _deps(task: Task, num_stages: int) -> list[tuple[int, str, int]]:
    s, m = task.stage, task.microbatch
    if task.kind == "F":
        return [] if s == 0 else [(s - 1, "F", m)]
    if task.kind == "W":
        return [(s, "I", m)]
    return [(s, "F", m)] + ([] if s == num_stages - 1 else [(s + 1, "I", m)])


def _produces(task: Task) -> list[tuple[int, str, int]]:
    s, m = task.stage, task.microbatch
    if task.kind == "B":  # a full backward is both halves at once
        return [(s, "I", m), (s, "W", m)]
    return [(s, task.kind, m)]


def _check_complete(
    orders: Mapping[int, Sequence[Task]], num_stages: int, num_microbatches: int
) -> None:
    got = sorted(str(t) for order in orders.values() for t in order)
    split = {(t.stage, t.microbatch) for o in orders.values() for t in o if t.kind in "IW"}
    want = sorted(
        str(Task(s, k, m))
        for s in range(num_stages)
        for m in range(num_microbatches)
        for k in (("F", "I", "W") if (s, m) in split else ("F", "B"))
    )
    if got != want:
        raise ValueError(
            "the orders do not run every stage's forward and backward exactly once per micro-batch"
        )
