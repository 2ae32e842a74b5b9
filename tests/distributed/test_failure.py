"""A rank that fails makes every rank raise, within seconds, an error naming it and its error;
a rank killed or stopped is named as lost; the library's groups have the world's timeout."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.common import reference
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

WITHIN_S = 30.0  # the scenarios' groups time out after 300 s, and their boards' grace_s is 60 s
ROLES = {0: "rank 0 (pipeline stage 0, dp_shard 0)", 3: "rank 3 (pipeline stage 1, dp_shard 1)"}


def _peer_fails(out: Path, origins: list[int], ending: str = "destroy") -> list[dict[str, Any]]:
    params = {"origins": origins, "ending": ending, "out_dir": str(out)}
    params["init_process_group"] = False  # the scenario's own, with a 300 s timeout
    return launch(4, "failure_scenarios.peer_fails", params, out, timeout=240)


def _assert_every_rank_names(
    seen: list[dict[str, Any]], origin: int, roles: dict[int, str] = ROLES
) -> float:
    """Every rank's error names the origin, its role and its error; returns the slowest raise."""
    failed_at = seen[origin]["failed_at"]
    for rank, s in enumerate(seen):
        assert "bad loss shape" in s["message"], f"rank {rank}: {s}"
        assert s["raised_at"] - failed_at < WITHIN_S, f"rank {rank}: {s}"
        if rank == origin:
            assert (s["type"], s["cause"]) == ("ValueError", None), f"rank {rank}: {s}"
            assert any(roles[origin] in note for note in s["notes"]), f"rank {rank}: {s}"
        else:
            assert s["type"] == "PeerFailedError", f"rank {rank}: {s}"
            assert s["origin"] == roles[origin], f"rank {rank}: {s}"
            assert f"{roles[origin]} failed with ValueError: bad loss shape" in s["message"]
            assert s["cause"] == "RuntimeError", f"rank {rank}: {s}"  # gloo's, chained
    slowest = max(s["raised_at"] for s in seen) - failed_at
    print(f"origin {origin}: every rank raised within {slowest:.3f}s of the failure")
    return slowest


def test_last_stage_failure_reaches_every_rank(tmp_path: Path) -> None:
    seen = _peer_fails(tmp_path, origins=[3])
    _assert_every_rank_names(seen, origin=3)
    for rank, s in enumerate(seen):  # the groups are dead, but tear down at once
        assert s["destroy_s"] < 5.0, f"rank {rank}: {s}"


def test_failure_on_the_store_host_reaches_every_rank(tmp_path: Path) -> None:
    # Rank 0 hosts the store and must not exit before the others read the record; the ranks
    # then exit without destroy_process_group (launch fails on a hang or a non-zero exit).
    seen = _peer_fails(tmp_path, origins=[0], ending="interpreter")
    _assert_every_rank_names(seen, origin=0)


def test_same_error_on_two_ranks_stays_their_own(tmp_path: Path) -> None:
    # Both last-stage ranks raise the same error at once: each keeps its own exception, the
    # first stage's ranks name whichever recorded first.
    seen = _peer_fails(tmp_path, origins=[2, 3])
    for rank in (2, 3):
        assert (seen[rank]["type"], seen[rank]["cause"]) == ("ValueError", None), seen[rank]
    first = {seen[0]["origin"], seen[1]["origin"]}
    assert len(first) == 1 and first <= {"rank 2 (pipeline stage 1, dp_shard 0)", ROLES[3]}
    for rank in (0, 1):
        assert seen[rank]["type"] == "PeerFailedError", seen[rank]
        assert "ValueError: bad loss shape" in seen[rank]["message"], seen[rank]


@pytest.mark.parametrize("schedule", ["1f1b", "zeropp"])
def test_loss_failure_inside_a_pipeline_step(tmp_path: Path, schedule: str) -> None:
    params = {"schedule": schedule, "init_process_group": False}
    seen = launch(4, "failure_scenarios.engine_step_fails", params, tmp_path, timeout=240)
    want = reference("sgd", clip=False, steps=1)["losses"][0]  # step 0 ran under the guard
    for rank, s in enumerate(seen):
        assert abs(s["loss0"] - want) < 1e-5, f"rank {rank}: loss {s['loss0']} vs {want}"
        assert s["new_keys"] == 0, f"rank {rank}: a step that succeeds wrote to the store: {s}"
        assert s["guard_us"] < 1000, f"rank {rank}: {s}"  # loose: a loaded machine; no I/O
        assert s["destroy_s"] < 5.0, f"rank {rank}: {s}"
    role = {"1f1b": "pipeline stage 1", "zeropp": "pipeline stages 1 and 3"}[schedule]
    roles = {3: f"rank 3 ({role}, dp_shard 1)"}
    _assert_every_rank_names(seen, origin=3, roles=roles)
    print(f"guard entry+exit: {max(s['guard_us'] for s in seen):.1f} us")


def test_mesh_and_tied_groups_time_out_with_the_world(tmp_path: Path) -> None:
    # torch would give them 30 min (gloo) whatever the world group's timeout: a rank blocked on
    # a stopped peer waited that long.
    params = {"timeout_s": 5.0, "init_process_group": False}
    seen = launch(4, "failure_scenarios.mesh_timeouts", params, tmp_path, timeout=120)
    for rank, s in enumerate(seen):
        assert (s["pp"], s["dp_replicate"], s["dp_shard"]) == (5.0, 5.0, 5.0), f"rank {rank}: {s}"
        assert s["tied"] == (5.0 if rank in (0, 3) else None), f"rank {rank}: {s}"
    for rank in (0, 3):  # a point-to-point recv over pp, an all_reduce over dp_shard
        assert "Timed out" in seen[rank]["message"], f"rank {rank}: {seen[rank]}"
        assert 4.5 < seen[rank]["blocked_s"] < 8.5, f"rank {rank}: {seen[rank]}"
    print(f"blocked ranks raised after {[round(seen[r]['blocked_s'], 2) for r in (0, 3)]} s")


LOST = {1: "rank 1 (pipeline stage 0, dp_shard 1)", 2: "rank 2 (pipeline stage 1, dp_shard 0)"}


def _every_survivor_names(tmp_path: Path, how: str, victim: int, timeout_s: float) -> float:
    """Every other rank raises PeerFailedError naming the lost rank; returns the slowest one's
    time from the loss to done (process group destroyed)."""
    params = {"how": how, "victim": victim, "timeout_s": timeout_s, "out_dir": str(tmp_path)}
    params["init_process_group"] = False
    seen = launch(4, "failure_scenarios.lost_rank", params, tmp_path, timeout=timeout_s + 150)
    kept = seen[victim]  # the launched process that ran the victim as its child
    assert kept["returncode"] == -signal.SIGKILL and kept["lost_at"] is not None, kept
    with pytest.raises(ProcessLookupError):
        os.kill(kept["pid"], 0)  # killed and reaped: nothing left behind
    said = f"{LOST[victim]} was lost: it did not answer within 5 s (killed, crashed or stopped)"
    survivors = [s for rank, s in enumerate(seen) if rank != victim]
    for s in survivors:
        assert (s["type"], s["origin"]) == ("PeerFailedError", LOST[victim]), s
        assert s["message"].startswith(said), s
        assert s["cause"] is not None, s  # the transport error or timeout, chained
    raised = max(s["raised_at"] for s in survivors) - kept["lost_at"]
    done = max(s["done_at"] for s in survivors) - kept["lost_at"]
    print(f"{how} rank {victim} (world timeout {timeout_s:g} s): every other rank raised within")
    print(f"{raised:.1f} s and was done (process group destroyed) within {done:.1f} s")
    return done


def test_a_killed_rank_is_named_on_every_other_rank(tmp_path: Path) -> None:
    # A 300 s timeout: the connections the killed process leaves wake the others, not a timeout.
    assert _every_survivor_names(tmp_path, "kill", victim=2, timeout_s=300.0) < WITHIN_S


def test_a_stopped_rank_is_named_on_every_other_rank(tmp_path: Path) -> None:
    # A stopped process keeps its connections open: the others wake at the world timeout.
    timeout_s = 10.0
    assert _every_survivor_names(tmp_path, "stop", victim=1, timeout_s=timeout_s) < timeout_s + 30
