"""Ranks lost anywhere a run communicates are named on every survivor, in time, in both fronts,
and a run resumed from the last complete checkpoint continues exactly
(tests/distributed/fault_scenarios.py runs the cases)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.fault_scenarios import CASES, summary
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed
TIMEOUT_S = 20.0


def _run(tmp_path: Path, cases: list[str]) -> list[dict]:
    params = {"cases": cases, "out": str(tmp_path / "out"), "timeout_s": TIMEOUT_S}
    params["init_process_group"] = False
    return launch(4, "fault_scenarios.run_cases", params, tmp_path, timeout=200 * len(cases))


def _assert_named(reports: list[dict], case: str) -> None:
    got = summary(reports, case)
    _, victim, how, _ = CASES[case]
    assert got["hung"] == 0 and got["named"] == got["survivors"], (case, got)
    bound = TIMEOUT_S + 30 if how == "stop" else 30.0  # a killed rank: no timeout needed
    assert got["slowest_s"] is not None and got["slowest_s"] < bound, (case, got)
    print(f"{case}: victim rank {victim} named on every survivor within {got['slowest_s']:.1f} s")


def _assert_continues(reports: list[dict], case: str) -> None:
    straight_case = f"{CASES[case][0]}_straight"
    for rank, report in enumerate(reports):
        straight, resumed = report[straight_case], report[f"resume:{case}"]
        assert resumed["type"] == "no error", (rank, resumed)
        assert resumed["steps"] == straight["steps"][2:], (rank, resumed["steps"])
        torch.testing.assert_close(
            torch.tensor(resumed["losses"]), torch.tensor(straight["losses"][2:]), rtol=0, atol=0
        )
        for name, value in straight["params"].items():
            torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=0, msg=name)


def test_a_rank_lost_in_an_async_save_is_named_on_every_rank(tmp_path: Path) -> None:
    # The save's own thread meets the loss; the survivors' training steps name it.
    reports = _run(tmp_path, ["lightning_async_save"])
    _assert_named(reports, "lightning_async_save")


@pytest.mark.slow  # 13 cases of 4-rank jobs: bench/slow_tests.py (and bench/bench_faults.py)
def test_every_fault_case_is_named_and_resumes_continue_exactly(tmp_path: Path) -> None:
    saves = ["lightning_sync_save", "lightning_async_save", "accelerate_save_state"]
    cases = ["lightning_straight", "accelerate_straight", *CASES]
    cases += [f"resume:{c}" for c in saves]
    reports = _run(tmp_path, cases)
    for case in CASES:
        _assert_named(reports, case)
    for case in saves:
        _assert_continues(reports, case)
