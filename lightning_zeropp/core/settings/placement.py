"""Schedule names and where each schedule puts its stages (torch-free: the config checks names
and placements without importing the schedules).

Three placement styles cover the schedules:
- "single": one stage per rank, stage i on pipeline rank i (GPipe, 1F1B);
- "looped": `num_chunks` stages per rank, rank r holds r, r + pp, r + 2pp, ... (Interleaved1F1B,
  LoopedBFS, InterleavedZeroBubble, ZeroPP);
- "v": two stages per rank folded in a V, rank r holds r and 2pp - 1 - r (ZBVZeroBubble, DualPipeV).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "SCHEDULE_ROWS",
    "SPLIT_BACKWARD_SCHEDULES",
    "STYLES",
    "ScheduleRow",
    "Style",
    "rank_of_stage",
    "schedule_style",
    "splits_backward",
    "stage_ids_for_rank",
]

Style = Literal["single", "looped", "v"]


@dataclass(frozen=True)
class ScheduleRow:
    """Everything the library knows about one schedule, in one place: adding one of torch's
    schedules is one row here (the runtime resolves `torch_class` by name in
    `torch.distributed.pipelining`, as torchtitan does; the config accepts that name, any case,
    with or without its "Schedule" prefix)."""

    name: str  # the library's name (`schedule=...`)
    style: Style  # where its stages sit (module docstring)
    torch_class: str | None  # the class in torch.distributed.pipelining; None: the library's own
    split_backward: bool = False  # its backward is separate input- and weight-gradient tasks
    aliases: tuple[str, ...] = ()  # further names accepted (torch's class name is already)


SCHEDULE_ROWS: tuple[ScheduleRow, ...] = (
    ScheduleRow("gpipe", "single", "ScheduleGPipe"),
    ScheduleRow("1f1b", "single", "Schedule1F1B"),
    ScheduleRow("interleaved_1f1b", "looped", "ScheduleInterleaved1F1B"),
    ScheduleRow("looped_bfs", "looped", "ScheduleLoopedBFS"),
    ScheduleRow("interleaved_zb", "looped", "ScheduleInterleavedZeroBubble", True, ("interleavedzb",)),
    ScheduleRow("zbv", "v", "ScheduleZBVZeroBubble", True),
    ScheduleRow("dualpipev", "v", "ScheduleDualPipeV", True),
    # ZeroPP's unit schedule (core.schedule.zeropp); splits backward with `split_backward=True`
    ScheduleRow("zeropp", "looped", None),
)  # fmt: skip

# Derived views, for the checks that need one fact of every schedule.
STYLES: dict[str, Style] = {row.name: row.style for row in SCHEDULE_ROWS}
# torch's schedules whose backward is an input-gradient and a weight-gradient task (zeropp's is,
# with split_backward). A unit test checks this against the schedules' own actions.
SPLIT_BACKWARD_SCHEDULES = tuple(row.name for row in SCHEDULE_ROWS if row.split_backward)


def splits_backward(schedule: str, split_backward: bool | None) -> bool:
    """Whether a (resolved) schedule runs separate input- and weight-gradient tasks."""
    return schedule in SPLIT_BACKWARD_SCHEDULES or bool(split_backward)


def schedule_style(name: str) -> Style:
    """Placement style of a schedule name (see module docstring)."""
    return STYLES[name]


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
