"""The benchmark harness (bench/harness.py): row order, the step clock's windows, the summaries.

Every front benchmark reads its figures through these pieces, so a wrong window or share would
skew all of them at once; the expected values below are worked out by hand.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
try:
    import harness
finally:
    sys.path.pop(0)


def test_rows_alternate_their_order_run_by_run() -> None:
    order = list(harness.alternating(["a", "b", "c"], 3))
    assert order == [(1, "a"), (1, "b"), (1, "c"), (2, "c"), (2, "b"), (2, "a")] + [
        (3, "a"),
        (3, "b"),
        (3, "c"),
    ]


def _warm_marker() -> None:
    time.sleep(0.001)


def _timed_marker() -> None:
    time.sleep(0.001)


class _Model:
    def inner(self) -> None:
        time.sleep(0.02)


def test_step_clock_times_only_the_timed_window(group: None) -> None:
    """2 warm-up steps, 3 timed, then 1 more (as bench_zeropp's counted steps): the window's wall
    time covers the 3 timed sleeps and not the long last step; cProfile sees only timed steps."""
    sleeps = [0.05, 0.05, 0.03, 0.04, 0.05, 0.8]
    model = _Model()
    clock = harness.StepClock(
        2, 3, inner=("inner", "unused"), profiler=cProfile.Profile(), reduce_loss=lambda x: x + 1
    )
    clock.wrap(model, "inner", "inner")
    for step, sleep in enumerate(sleeps):
        clock.start()
        (_timed_marker if clock.timed else _warm_marker)()
        time.sleep(sleep / 2)
        clock.lap("first")
        time.sleep(sleep / 2)
        if step == 3:
            model.inner()
        clock.lap("second")
        clock.stop(float(step))
    assert len(clock.records) == 6
    assert clock.losses == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert clock.times == [r["total"] for r in clock.records[2:5]]
    for record, sleep in zip(clock.records, sleeps, strict=True):
        assert sleep <= record["total"] < sleep + 0.3
        assert record["first"] + record["second"] == pytest.approx(record["total"], abs=5e-3)
        assert record["unused"] == 0.0
    assert [r["inner"] > 0.019 for r in clock.records] == [False] * 3 + [True] + [False] * 2
    timed = sum(sleeps[2:5]) + 0.02
    assert timed <= clock.wall_s < timed + 0.5  # the 0.8 s step after the window is not in it
    assert 0.0 <= clock.cpu_s < clock.wall_s  # sleeping costs no CPU time
    assert clock.proc_stat and all(v >= 0 for v in clock.proc_stat.values())
    profiled = {func for (_, _, func) in pstats.Stats(clock.profiler).stats}  # type: ignore[attr-defined]
    assert "_timed_marker" in profiled and "_warm_marker" not in profiled


def test_summaries_take_the_slowest_rank_and_the_machines_other_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert harness.slowest_per_step([[1.0, 5.0], [2.0, 3.0]]) == [2.0, 5.0]
    assert harness.summed_per_step([[1.0, 5.0], [2.0, 3.0]]) == [3.0, 8.0]
    with pytest.raises(ValueError):
        harness.slowest_per_step([[1.0, 5.0], [2.0]])
    monkeypatch.setattr(harness.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(harness.os, "sysconf", lambda name: 100)  # clock ticks per second
    # Two ranks, 8 CPU seconds each in a 10 s window on 2 cores; the machine was busy 19 s of
    # its 21 (user 18 s, steal 1 s; idle 2 s): other processes took 19 - 16 = 3 s of 20.
    stat = {"user": 1800, "idle": 200, "iowait": 0, "steal": 100}
    ranks = [
        {"timed_cpu_s": 8.0, "timed_wall_s": 10.0, "timed_proc_stat": stat},
        {"timed_cpu_s": 8.0, "timed_wall_s": 9.0, "timed_proc_stat": stat},
    ]
    shares = harness.load_shares(ranks)
    assert shares["cpu_share"] == pytest.approx(0.8)
    assert shares["others_share"] == pytest.approx(0.15)
    assert shares["steal_share"] == pytest.approx(100 / 2100)
    runs = [{"row": "a", "x": 1.0}, {"row": "b", "x": 7.0}, {"row": "a", "x": 3.0}]
    assert harness.med(runs, "a", "x") == 2.0


def test_launch_passes_every_option_to_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(harness, "launch_ranks", lambda *args: seen.append(args) or [])
    harness.launch("b.py", "row", 8, 60.0, world=8, per_device_batch=4)  # `world`: a rank option
    assert seen == [("b.py", "row", 8, ["--world", "8", "--per-device-batch", "4"], 60.0, None)]


def test_markdown_table_and_worker_options() -> None:
    assert harness.table(["a", "b"], "lr", [[1, "x"]]) == ["| a | b |", "|---|---:|", "| 1 | x |"]
    parser = harness.arg_parser("doc", steps=6, warmup=2, repeats=3, rows="a,b")
    args = parser.parse_args(["--worker", "a", "--out", "/tmp/x", "--steps", "1"])
    assert (args.worker, args.out, args.steps, args.warmup, args.repeats) == (
        "a",
        "/tmp/x",
        1,
        2,
        3,
    )
    with pytest.raises(SystemExit):
        harness.pick_rows(parser, "a,c", ["a", "b"])
