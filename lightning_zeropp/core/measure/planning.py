"""What re-planning for new batch shapes costs a run: schedules built, evicted, and their time.

torch's pipeline stages fix their buffer shapes at their first step (a forward and a backward
shape-inference pass over every stage, with metadata sent between stages), so the engine builds
one schedule per batch shape and keeps the 8 most recently used. Batches whose shapes change
every step (padding to the longest row, packed documents) pay that pass once per new shape, and
again for a shape whose schedule was evicted. `PlanningStats` counts both and times building
plus shape inference, so a front can report it and a run can see when bucketing lengths pays.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["PlanningStats"]

log = logging.getLogger(__name__)


@dataclass
class PlanningStats:
    """Counters of one engine: `schedules_built` (training and evaluation), `evictions` (a
    schedule dropped for a newer shape), `seconds` (building them and their shape inference,
    wall time on this rank: it includes waiting for the neighbouring stages' metadata)."""

    schedules_built: int = 0
    evictions: int = 0
    seconds: float = 0.0
    _warned: bool = False

    @contextmanager
    def timed(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - started

    def built(self) -> None:
        self.schedules_built += 1

    def evicted(self, kept: int) -> None:
        self.evictions += 1
        if not self._warned:
            self._warned = True
            log.warning(
                "batches came in more than %d shapes: each new shape rebuilds a pipeline "
                "schedule (a shape-inference pass over every stage), and older ones are being "
                "dropped and rebuilt. Pad lengths to a few buckets (seq_buckets= in the fronts) "
                "to bound it.",
                kept,
            )

    def summary(self) -> dict[str, float]:
        return {
            "schedules_built": float(self.schedules_built),
            "schedule_evictions": float(self.evictions),
            "planning_seconds": self.seconds,
        }
