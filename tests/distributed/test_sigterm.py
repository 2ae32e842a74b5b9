"""SIGTERM ends every rank cleanly in every front: at the next step boundary, exit status 143
on every rank, a message naming SIGTERM on every rank, no hang, and a restart from the
checkpoint saved on the way out (`save_on_sigterm=True`) continues exactly
(tests/distributed/sigterm_scenarios.py runs the cases)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.launch import launch
from tests.distributed.sigterm_scenarios import STEPS

pytestmark = pytest.mark.distributed
TIMEOUT_S = 20.0


def _run(tmp_path: Path, cases: list[str]) -> list[dict]:
    params = {"cases": cases, "out": str(tmp_path / "out"), "timeout_s": TIMEOUT_S}
    params["init_process_group"] = False
    return launch(2, "sigterm_scenarios.run_cases", params, tmp_path, timeout=120 * len(cases))


def _assert_stopped(reports: list[dict], case: str, step: int | None) -> None:
    for rank, report in enumerate(reports):
        seen = report[case]
        assert not seen["hung"], (case, rank, seen)
        assert seen["exit"] == 143, (case, rank, seen)
        assert seen["type"] == "PreemptedError", (case, rank, seen)
        assert "stopped by SIGTERM" in seen["message"], (case, rank, seen)
        if step is not None:
            assert f"at step {step};" in seen["message"], (case, rank, seen)
        assert seen["took_s"] < TIMEOUT_S + 60, (case, rank, seen)  # stopped, not timed out
    print(f"{case}: {reports[0][case]['message']}")


def _assert_resumes(reports: list[dict], case: str, done: int) -> None:
    front = case.split("_")[0]
    for rank, report in enumerate(reports):
        straight, resumed = report[f"{front}_straight"], report[f"resume:{case}"]
        assert straight["exit"] == 0 and resumed["exit"] == 0, (rank, straight, resumed)
        assert resumed["steps"] == straight["steps"][done:], (rank, resumed["steps"])
        torch.testing.assert_close(
            torch.tensor(resumed["losses"]), torch.tensor(straight["losses"][done:]),
            rtol=0, atol=1e-5,
        )  # fmt: skip
        for name, value in straight["params"].items():
            torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=1e-5)


def test_sigterm_in_lightning_stops_every_rank_named_and_resumes_exactly(tmp_path: Path) -> None:
    cases = [
        "lightning_straight",
        "lightning_step_one",
        "lightning_validation_all",
        "resume:lightning_step_one",
    ]
    reports = _run(tmp_path, cases)
    # rank 1 is signalled inside step 3's schedule (global_step 2): the step ends, then all stop
    _assert_stopped(reports, "lightning_step_one", 3)
    assert "saved checkpoint at" in reports[0]["lightning_step_one"]["message"]
    _assert_stopped(reports, "lightning_validation_all", 2)
    _assert_resumes(reports, "lightning_step_one", 3)


@pytest.mark.slow  # 4 more 2-rank fits: bench/slow_tests.py
def test_sigterm_in_lightning_at_setup_in_a_save_and_after_the_last_step(tmp_path: Path) -> None:
    cases = [
        "lightning_setup_one",
        "lightning_step_all",
        "lightning_save_one",
        "lightning_last_one",
    ]
    reports = _run(tmp_path, cases)
    _assert_stopped(reports, "lightning_setup_one", 0)  # before the first step
    # rank 0 is signalled before step 3's agreement: nobody runs it
    _assert_stopped(reports, "lightning_step_all", 2)
    _assert_stopped(reports, "lightning_save_one", 2)  # in the save after step 2
    _assert_stopped(reports, "lightning_last_one", 6)  # no later step: the end of fit agrees


def test_sigterm_in_an_accelerate_loop_stops_every_rank_named_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    cases = [
        "accelerate_straight",
        "accelerate_setup_one",
        "accelerate_step_one",
        "accelerate_validation_all",
        "accelerate_last_one",
        "resume:accelerate_step_one",
    ]
    reports = _run(tmp_path, cases)
    # after the last step: before, the loop ended with exit 0 and no word; end_training agrees
    _assert_stopped(reports, "accelerate_last_one", STEPS)
    for report in reports:
        # the handler before the library's is back once the run ends (before: the library's
        # stayed, recording signals nobody acted on)
        assert report["accelerate_straight"]["handler_restored"], report["accelerate_straight"]
        # the step count goes on from the checkpoint's 3 batches (before: 3, from 0)
        assert report["resume:accelerate_step_one"]["batches"] == STEPS
    _assert_stopped(reports, "accelerate_setup_one", 0)
    # rank 1 is signalled inside step 4's schedule: the step ends, then every rank stops
    _assert_stopped(reports, "accelerate_step_one", 4)
    assert "saved state at" in reports[0]["accelerate_step_one"]["message"]
    _assert_stopped(reports, "accelerate_validation_all", 2)
    _assert_resumes(reports, "accelerate_step_one", 4)


def test_sigterm_in_the_hf_trainer_stops_every_rank_named_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    cases = ["trainer_straight", "trainer_step_one", "trainer_last_one", "resume:trainer_step_one"]
    reports = _run(tmp_path, cases)
    _assert_stopped(reports, "trainer_last_one", STEPS)  # after the last step: train() agrees
    _assert_stopped(reports, "trainer_step_one", 2)  # rank 1, before step 3's agreement
    assert "checkpoint-2" in reports[0]["trainer_step_one"]["message"]
    _assert_resumes(reports, "trainer_step_one", 2)
    for report in reports:  # train() gives SIGTERM back to the handler before it
        assert report["trainer_straight"]["handler_restored"], report["trainer_straight"]
