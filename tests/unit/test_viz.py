"""The schedule pictures: planned timelines, Gantt PNG, Chrome trace (no processes started)."""

import dataclasses
import json

import pytest

from lightning_zeropp import viz
from lightning_zeropp.core import ZeroPPConfig
from lightning_zeropp.core.measure.timeline import Interval, Timeline, bubble_fraction
from lightning_zeropp.core.schedule.zeropp import bubble_formula

pytest.importorskip("matplotlib")


def test_planned_timelines_carry_every_task_and_one_gather_per_block():
    config = ZeroPPConfig(schedule="zeropp", pp_size=2, num_microbatches=8, unit_size=4)
    timelines = viz.planned_timelines(config.resolve(2))
    for tl in timelines:
        compute = [i for i in tl.intervals if i.lane == "compute"]
        assert len(compute) == 2 * 8 * 3  # two chunks x 8 micro-batches x (F, I, W)
        assert sum(i.kind == "all_gather" for i in tl.intervals) == 2 * 3 - 1  # shared at the seam
    no_split = dataclasses.replace(config.resolve(2), split_backward=False)
    assert bubble_fraction(timelines) < bubble_fraction(viz.planned_timelines(no_split))


def test_plan_only_command_writes_the_chart_and_summary(tmp_path):
    summary = viz.main(["--pp", "4", "--microbatches", "8", "--plan-only", "--out", str(tmp_path)])
    assert (tmp_path / "planned.png").read_bytes()[:4] == b"\x89PNG"
    assert summary["bubble_formula_no_split"] == pytest.approx(bubble_formula(4, 2, 4))
    assert 0 < summary["bubble_planned"] < summary["bubble_formula_no_split"]
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def test_chrome_trace(tmp_path):
    tl = Timeline(rank=1, intervals=[Interval("compute", "F", 0.5, 1.0, 3, 0)])
    viz.write_chrome_trace([tl], tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    (x,) = [e for e in events if e["ph"] == "X"]
    assert (x["name"], x["pid"], x["ts"], x["dur"]) == ("3F0", 1, 0.5e6, 0.5e6)
