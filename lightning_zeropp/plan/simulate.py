"""A step, simulated: each pipeline rank's tasks replayed in order against their dependencies, with
their compute and communication on a compute lane and a communication lane.

Torch-free. The inputs are what a schedule does (each rank's ordered tasks, flagged where a task
gathers its stage's weights or reduce-scatters its gradients) and what each piece costs
(`StageCost`, in seconds); the output is when every rank finishes and how much of that it spent
computing, so the bubble is what the schedule's own order leaves idle, not a formula.

How a task runs (the stage's FSDP units are its segments, in forward order; a backward visits them
in reverse):
- a segment's gather, when the task gathers, runs on the communication lane and the segment's
  compute waits for it; with `overlap` (collectives on their own stream, as on GPUs) the next
  segment's gather runs during this segment's compute, as FSDP2 prefetches; without it (gloo on
  CPU, where a collective blocks its caller) the two lanes are one;
- a segment's reduce-scatter, when the task reduces, follows that segment's compute on the
  communication lane;
- a task waits for its inputs: a forward for the previous stage's forward of the same micro-batch,
  a backward for the next stage's (or, on the last stage, its own forward), plus the transfer
  time when the two stages sit on different ranks; a weight-gradient task W for its I.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Op", "RankTimeline", "StageCost", "compute_seconds", "simulate"]


@dataclass(frozen=True)
class StageCost:
    """Seconds one micro-batch costs on one stage, per segment (FSDP unit) in forward order."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]  # a full backward (input and weight gradients)
    gather: tuple[float, ...] = ()  # all-gather of each segment's weights (empty: none)
    gather_node: tuple[float, ...] = ()  # ... from hpZ's in-node copy (empty: as `gather`)
    reduce: tuple[float, ...] = ()  # reduce-scatter of each segment's gradients (empty: none)
    send: float = 0.0  # this stage's output reaching the next stage's rank (and its gradient back)
    # part of a backward that is the weight-gradient task W: for every segment, or per segment
    # (the chunked loss computes the head's weight gradient in the input pass: its W share is 0)
    weight_share: float | tuple[float, ...] = 0.5
    recompute: bool = False  # a backward first recomputes the forward
    overhead: float = 0.0  # fixed seconds of every task (the runtime's and FSDP's hooks)
    input_grad_in_weight: bool = False  # a split backward's I does nothing, its W everything


@dataclass(frozen=True)
class Op:
    """One task of a rank's program: F, B, I or W of `stage` on `microbatch`, gathering the
    stage's weights first (`gather`) and/or reduce-scattering its gradients after (`reduce`)."""

    kind: str
    stage: int
    microbatch: int
    gather: bool = False
    reduce: bool = False
    from_node: bool = False  # the gather reads hpZ's in-node copy


@dataclass
class RankTimeline:
    """What one pipeline rank did in the simulated step."""

    end: float = 0.0  # when its last compute or collective finished
    compute: float = 0.0  # seconds computing
    communication: float = 0.0  # seconds its communication lane was busy
    compute_end: float = 0.0
    comm_end: float = 0.0
    spans: list[tuple[str, int, int, float, float]] = field(default_factory=list)


def _segment_seconds(cost: StageCost, kind: str) -> list[float]:
    if kind == "F":
        return [cost.forward[0] + cost.overhead, *cost.forward[1:]]
    redo = cost.forward if cost.recompute else (0.0,) * len(cost.forward)
    n = len(cost.backward)
    given = cost.weight_share
    weights = (
        (1.0,) * n
        if cost.input_grad_in_weight
        else given
        if isinstance(given, tuple)
        else (given,) * n
    )
    shares = [{"B": 1.0, "I": 1.0 - w, "W": w}[kind] for w in weights]
    # the recomputation runs with the first part of the backward that runs at all
    redo_here = kind == "B" or (kind == "I") != cost.input_grad_in_weight
    out = [
        b * share + (r if redo_here else 0.0)
        for b, r, share in zip(cost.backward, redo, shares, strict=True)
    ]
    out[0] += cost.overhead
    return out[::-1]  # backward visits the units last to first


def _dependency(op: Op, num_stages: int) -> tuple[str, int] | None:
    if op.kind == "F":
        return ("F", op.stage - 1) if op.stage > 0 else None
    if op.kind == "W":
        return ("I", op.stage)
    return ("F", op.stage) if op.stage == num_stages - 1 else ("BI", op.stage + 1)


def simulate(
    programs: Mapping[int, Sequence[Op]],
    costs: Sequence[StageCost],
    rank_of_stage: Mapping[int, int],
    overlap: bool,
) -> dict[int, RankTimeline]:
    """Replay every rank's program; raises if the programs wait on each other forever."""
    num_stages = len(costs)
    ends: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> compute end
    lines = {r: RankTimeline() for r in programs}
    position = dict.fromkeys(programs, 0)
    segments = _Segments(costs)
    while any(position[r] < len(programs[r]) for r in programs):
        progressed = False
        for rank, program in programs.items():
            while position[rank] < len(program):
                op = program[position[rank]]
                ready = _ready(op, ends, costs, rank_of_stage, rank, num_stages)
                if ready is None:
                    break
                _run(op, ready, segments, lines[rank], ends, overlap)
                position[rank] += 1
                progressed = True
        if not progressed:
            stuck = {
                r: str(programs[r][position[r]]) for r in programs if position[r] < len(programs[r])
            }
            raise RuntimeError(f"the programs wait on each other forever: next tasks {stuck}")
    for line in lines.values():
        line.end = max(line.compute_end, line.comm_end)
    return lines


def compute_seconds(
    programs: Mapping[int, Sequence[Op]], costs: Sequence[StageCost]
) -> dict[int, float]:
    """Each rank's compute lane, busy: the sum of its tasks' segments (what `simulate` puts in
    `RankTimeline.compute`, without replaying anything)."""
    memo: dict[tuple[int, str], float] = {}
    out = {}
    for rank, program in programs.items():
        total = 0.0
        for op in program:
            key = (op.stage, op.kind)
            if key not in memo:
                memo[key] = sum(_segment_seconds(costs[op.stage], op.kind))
            total += memo[key]
        out[rank] = total
    return out


class _Segments:
    """Each (stage, kind)'s segment seconds and collectives in the order a task visits them,
    worked out once per simulation (a step replays the same few thousand times)."""

    def __init__(self, costs: Sequence[StageCost]) -> None:
        self.costs = costs
        self._memo: dict[tuple[int, str, bool, bool, bool], tuple[list[float], list, list]] = {}

    def __call__(self, op: Op) -> tuple[list[float], list[float], list[float]]:
        key = (op.stage, op.kind, op.gather, op.reduce, op.from_node)
        if key not in self._memo:
            cost = self.costs[op.stage]
            seconds = _segment_seconds(cost, op.kind)
            n = len(seconds)
            order = range(n) if op.kind == "F" else range(n - 1, -1, -1)
            source = cost.gather_node if op.from_node and cost.gather_node else cost.gather
            gathers = [source[k] if op.gather and source else 0.0 for k in order]
            reduces = [cost.reduce[k] if op.reduce and cost.reduce else 0.0 for k in order]
            self._memo[key] = (seconds, gathers, reduces)
        return self._memo[key]


def _ready(
    op: Op,
    ends: Mapping[tuple[str, int, int], float],
    costs: Sequence[StageCost],
    rank_of_stage: Mapping[int, int],
    rank: int,
    num_stages: int,
) -> float | None:
    dep = _dependency(op, num_stages)
    if dep is None:
        return 0.0
    kinds, stage = dep
    found = [ends[(k, stage, op.microbatch)] for k in kinds if (k, stage, op.microbatch) in ends]
    if not found:
        return None
    hop = min(stage, op.stage) if kinds != "I" else None  # the boundary crossed, if any
    if hop is not None and rank_of_stage[stage] != rank:
        return found[0] + costs[hop].send
    return found[0]


def _run(
    op: Op,
    ready: float,
    segments: _Segments,
    line: RankTimeline,
    ends: dict[tuple[str, int, int], float],
    overlap: bool,
) -> None:
    seconds, gathers, reduces = segments(op)
    start: float | None
    if not any(gathers) and not any(reduces):  # compute only: the segments back to back
        start = begin = max(line.compute_end, ready)
        for compute in seconds:
            begin += compute
            line.compute += compute
        line.compute_end = begin
        _finish(op, start, line, ends)
        return
    start = None
    previous_start = line.compute_end
    for compute, gather, reduce in zip(seconds, gathers, reduces, strict=True):
        if gather:
            # with overlap, a unit's gather may start once the previous unit's compute started
            at = (
                max(line.comm_end, previous_start)
                if overlap
                else max(line.comm_end, line.compute_end)
            )
            line.comm_end = at + gather
            line.communication += gather
            if not overlap:
                line.compute_end = line.comm_end
        begin = max(line.compute_end, line.comm_end if gather else 0.0, ready)
        start = begin if start is None else start
        previous_start = begin
        line.compute_end = begin + compute
        line.compute += compute
        if reduce:
            at = max(line.comm_end, line.compute_end)
            line.comm_end = at + reduce
            line.communication += reduce
            if not overlap:
                line.compute_end = line.comm_end
    _finish(op, start or ready, line, ends)


def _finish(
    op: Op, start: float, line: RankTimeline, ends: dict[tuple[str, int, int], float]
) -> None:
    ends[(op.kind, op.stage, op.microbatch)] = line.compute_end
    if op.kind == "B":  # a full backward also satisfies what waits on I
        ends[("I", op.stage, op.microbatch)] = line.compute_end
    line.spans.append((op.kind, op.stage, op.microbatch, start, line.compute_end))
