"""What one rank did during training steps, and when: compute, communication, and bytes held.

`StepRecorder(engine)` is a context manager around one or more `engine.train_step` calls. It
records, on this rank:
- compute intervals: each forward (F), full backward (B), input-gradient (I) and weight-gradient (W)
  task of each local stage, whatever the schedule (it wraps the stages' own methods);
- communication: every collective and point-to-point call (see `core.measure.comm.CommCounter`; an
  asynchronous call spans its launch, its wait shows up as a gap in compute);
- memory: the peak bytes of gathered (unsharded) weights, sampled at every task boundary, and the
  peak bytes of tensors saved for backward (activations), tracked by autograd's saved-tensor hooks.
Times are seconds from a barrier at entry, so ranks on one machine share a time base.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist

from lightning_zeropp.core._torch_private import unsharded_parameter_bytes
from lightning_zeropp.core.measure.axes import mesh_axis_namer
from lightning_zeropp.core.measure.comm import CommCounter, CommEvent
from lightning_zeropp.core.measure.memory import SavedActivations

__all__ = ["Interval", "StepRecorder", "Timeline", "bubble_fraction"]


@dataclass(frozen=True)
class Interval:
    """One piece of work: lane "compute" (kind F/B/I/W, stage, micro-batch) or "comm" (kind is
    the collective, e.g. all_gather, with its mesh axis and bytes)."""

    lane: str
    kind: str
    start: float
    end: float
    stage: int | None = None
    microbatch: int | None = None
    axis: str | None = None
    nbytes: int = 0


@dataclass
class Timeline:
    """A rank's record: intervals plus peaks (bytes)."""

    rank: int
    intervals: list[Interval] = field(default_factory=list)
    peak_unsharded_bytes: int = 0
    peak_activation_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Timeline:
        rest = {k: v for k, v in data.items() if k != "intervals"}
        return Timeline(intervals=[Interval(**i) for i in data["intervals"]], **rest)

    def busy(self) -> float:
        return sum(i.end - i.start for i in self.intervals if i.lane == "compute")

    def end(self) -> float:
        return max((i.end for i in self.intervals), default=0.0)


def bubble_fraction(timelines: Iterable[Timeline]) -> float:
    """Idle share of the ranks' compute time over the window every rank spans (0 = no bubble)."""
    timelines = list(timelines)
    window = max(t.end() for t in timelines) - min(
        (i.start for t in timelines for i in t.intervals if i.lane == "compute"), default=0.0
    )
    return 1.0 - sum(t.busy() for t in timelines) / (len(timelines) * window) if window else 0.0


class StepRecorder:
    """Record this rank's timeline while active (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.timeline = Timeline(rank=dist.get_rank())
        self._events: list[CommEvent] = []
        self._counter = CommCounter(mesh_axis_namer(engine.dims.mesh), events=self._events)
        self._t0 = 0.0
        self._saved = SavedActivations()

    def __enter__(self) -> StepRecorder:
        dist.barrier()
        self._t0 = time.perf_counter()
        for stage in self._engine.stages:
            self._wrap(stage, "forward_one_chunk", lambda a, k: "F")
            self._wrap(
                stage,
                "backward_one_chunk",
                lambda a, k: "B" if k.get("full_backward", True) else "I",
            )
            self._wrap(stage, "backward_weight_one_chunk", lambda a, k: "W")
        self._saved.__enter__()
        self._counter.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._counter.__exit__(*exc)
        self._saved.__exit__(*exc)
        self.timeline.peak_activation_bytes = self._saved.peak
        for stage in self._engine.stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                stage.__dict__.pop(name, None)
        for e in self._events:
            kind = e.kind
            self.timeline.intervals.append(
                Interval(
                    "comm", kind, e.start - self._t0, e.end - self._t0, None, None, e.axis, e.nbytes
                )
            )
        self.timeline.intervals.sort(key=lambda i: (i.start, i.lane))

    # ------------------------------------------------------------------ internals
    def _wrap(self, stage: Any, name: str, kind_of: Callable[[tuple, dict], str]) -> None:
        method = getattr(stage, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._sample()
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                end = time.perf_counter()
                mb = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id"))
                self.timeline.intervals.append(
                    Interval(
                        "compute",
                        kind_of(args, kwargs),
                        start - self._t0,
                        end - self._t0,
                        stage.stage_index,
                        mb,
                    )
                )
                self._sample()

        stage.__dict__[name] = timed  # instance attribute: shadows the method while recording

    def _sample(self) -> None:
        gathered = sum(unsharded_parameter_bytes(s.submod) for s in self._engine.stages)
        t = self.timeline
        t.peak_unsharded_bytes = max(t.peak_unsharded_bytes, gathered)
