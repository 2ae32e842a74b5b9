"""The rank side of the benchmark harness (see harness.py): a rank's start, its step clock, its end.

`start_rank` sets one thread and a traceback before the row's deadline; `StepClock` times the
rank's steps behind a barrier (wall and CPU time per step, laps by code line, wrapped inner calls,
an optional cProfile over the timed steps, and the timed window's CPU, wall and /proc/stat);
`slowest` takes each step's time as its slowest rank took it; `finish_rank` writes the rank's
JSON atomically and tears the process group down on every rank together.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import resource
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common import proc_stat

__all__ = [
    "StepClock",
    "finish_rank",
    "max_rss_kib",
    "process_start",
    "rss_figures",
    "slowest",
    "start_rank",
]


def start_rank(timeout_s: float) -> int:
    """A rank's start: one thread (OMP_NUM_THREADS=1 is set by the driver), a traceback in the
    rank's log 15 s before the row's deadline (where it hangs, if it does); returns the rank."""
    import torch

    faulthandler.dump_traceback_later(timeout_s - 15, exit=False)
    torch.set_num_threads(1)
    return int(os.environ["RANK"])


def max_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def rss_figures(start_kib: int) -> dict[str, int]:
    """Peak RSS now (`ru_maxrss`) and its growth since `start_kib`, in bytes."""
    end = max_rss_kib()
    return {"peak_rss_bytes": end * 1024, "peak_rss_growth_bytes": (end - start_kib) * 1024}


def process_start(default: float) -> float:
    """This process's start (epoch seconds, 10 ms resolution) from /proc: before Python itself."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, IndexError, ValueError):
        return default


def slowest(times: Sequence[float]) -> list[float]:
    """Each step's time, as its slowest rank took (an all-reduce: every rank calls it)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def finish_rank(out: Path, rank: int, result: dict[str, Any]) -> None:
    """Write rank<r>.json (whole, by rename: the driver watches for it), then tear the process
    group down on every rank together (no rank destroys its group while a peer still uses it)."""
    import torch.distributed as dist

    partial = out / f"rank{rank}.json.partial"
    partial.write_text(json.dumps(result))
    partial.rename(out / f"rank{rank}.json")
    faulthandler.dump_traceback_later(10, exit=False)  # tell where teardown hangs, if it does
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class StepClock:
    """A rank's steps: call `start()` before each step and `stop(loss)` after it.

    Every step (warm-up included) gets a record {"total": wall s, "cpu": this process's CPU s,
    **laps, **inner}; `laps` split the step by code line (`lap(name)`: the time since the last
    lap or the start), `inner` holds the time of calls wrapped by `wrap` (0.0 where none ran).
    The timed steps are those after `warmup`, `steps` of them; over them the clock keeps this
    process's CPU and wall time and the machine's /proc/stat (`load_shares` reads them), and
    runs `profiler` (a cProfile.Profile) if given. `reduce_loss` (e.g. a mean over ranks) maps
    each step's loss after the step's time is taken.
    """

    def __init__(
        self,
        warmup: int,
        steps: int,
        *,
        inner: Sequence[str] = (),
        profiler: Any = None,
        reduce_loss: Callable[[float], float] | None = None,
    ) -> None:
        self.warmup, self.steps = warmup, steps
        self.inner_names = tuple(inner)
        self.profiler, self.reduce_loss = profiler, reduce_loss
        self.records: list[dict[str, float]] = []
        self.losses: list[float] = []
        self.cpu_s = self.wall_s = 0.0
        self.proc_stat: dict[str, int] = {}
        self._inner: dict[str, float] = {}
        self._laps: dict[str, float] = {}
        self._t = self._start = self._cpu = self._cpu0 = self._wall0 = 0.0
        self._stat0: dict[str, int] = {}

    @property
    def timed(self) -> bool:
        """Whether the step being run (or about to be) is a timed one."""
        return self.warmup <= len(self.records) < self.warmup + self.steps

    @property
    def times(self) -> list[float]:
        """The timed steps' wall times."""
        return [r["total"] for r in self.records[self.warmup : self.warmup + self.steps]]

    @property
    def cpu_times(self) -> list[float]:
        """The timed steps' CPU times (this process)."""
        return [r["cpu"] for r in self.records[self.warmup : self.warmup + self.steps]]

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        """Time every call of `obj.attr` (an instance attribute shadowing the method: this
        process, this object only) into the step's `name`."""
        inner = getattr(obj, attr)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._inner[name] = self._inner.get(name, 0.0) + time.perf_counter() - t0

        object.__setattr__(obj, attr, timed)

    def start(self) -> None:
        import torch.distributed as dist

        if len(self.records) == self.warmup:
            self._cpu0, self._wall0 = time.process_time(), time.perf_counter()
            self._stat0 = proc_stat()
        dist.barrier()  # start every step together: the time is the step's, not the skew's
        self._laps, self._inner = {}, {}
        if self.profiler is not None and self.timed:
            self.profiler.enable()
        self._cpu = time.process_time()
        self._start = self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self._laps[name] = now - self._t
        self._t = now

    def stop(self, loss: Any) -> None:
        """End the step; `loss` (a float, or a tensor read after the time is taken)."""
        total = time.perf_counter() - self._start
        cpu = time.process_time() - self._cpu
        if self.profiler is not None and self.timed:
            self.profiler.disable()
        loss = float(loss)
        self.losses.append(self.reduce_loss(loss) if self.reduce_loss else loss)
        inner = {k: self._inner.get(k, 0.0) for k in self.inner_names}
        self.records.append({"total": total, "cpu": cpu, **self._laps, **inner})
        if len(self.records) == self.warmup + self.steps:
            self.cpu_s = time.process_time() - self._cpu0
            self.wall_s = time.perf_counter() - self._wall0
            end = proc_stat()
            self.proc_stat = {k: end[k] - self._stat0.get(k, 0) for k in end}

    def result(self) -> dict[str, Any]:
        """What a rank's JSON holds of the clock: timed step times, every loss, the window."""
        return {
            "step_times_s": self.times,
            "losses": self.losses,
            "timed_cpu_s": self.cpu_s,
            "timed_proc_stat": self.proc_stat,
            "timed_wall_s": self.wall_s,
        }
