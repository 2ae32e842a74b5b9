"""An elastic torchrun job (`--nnodes 1:2`, c10d rendezvous, `--max-restarts 1`) on two emulated
hosts (a UTS namespace each, `elastic_cluster.py`) loses a node mid-epoch: the surviving agent
restarts on its own host, the fit resumes from the last checkpoint with the same global batch
(the data-parallel width halves, each rank's micro-batches double) and ends with the numbers of
one uninterrupted process (1e-5: losses after the restart, final parameters); a pipeline that
does not fit the smaller world is refused on every rank, naming why. Also on the emulated hosts,
each in its network namespace: torchrun's c10d rendezvous across them, and `accelerate launch`
with one task per host, each training like one process. Needs root.
Scenarios: elastic_scenarios.py (the restart), hosts_scenarios.py, accelerate_scenarios.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from tests.distributed.common import reference
from tests.distributed.conftest import assert_matches_reference
from tests.distributed.elastic_cluster import run_agents, worker_logs
from tests.distributed.elastic_scenarios import GLOBAL_ROWS, ROWS
from tests.distributed.hosts_cluster import TwoLinks, unavailable

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PIPE = {"pp_size": 2, "dp_shard_size": 2, "schedule": "1f1b", "num_microbatches": 2}
KILL_STEP = 6  # node B dies before step 6 (mid-epoch 1): the last checkpoint is step 5's


def _uninterrupted() -> tuple[dict, list[list[int]]]:
    """One process on the global batch, in the order Lightning's DistributedSampler gives it
    (one permutation per epoch, seed 0 + epoch): the numbers every layout must match."""
    import os

    os.environ.setdefault("WORLD_SIZE", "1")  # resume_scenarios reads it at import
    from tests.distributed.resume_scenarios import TokenRows

    data = TokenRows(ROWS)
    batches, rows = [], []
    for epoch in range(2):
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True)
        sampler.set_epoch(epoch)
        for ids in torch.tensor(list(sampler)).split(GLOBAL_ROWS):
            batches.append((data.x[ids], data.y[ids]))
            rows.append(sorted(data.x[ids, 0].tolist()))
    return reference("adamw", False, len(batches), batches=batches), rows


def _read(out: Path, world: int) -> list[dict]:
    return [torch.load(out / f"result{r}.pt", weights_only=False) for r in range(world)]


def test_a_lost_node_restarts_on_the_other_and_continues_exactly(tmp_path: Path) -> None:
    if (why := unavailable()) is not None:
        pytest.skip(why)
    params = {"out": str(tmp_path / "ckpt"), "pp_size": 2, "kill_step": KILL_STEP}
    codes = run_agents("elastic_scenarios.shrink", params, tmp_path, timeout=600)
    tail = (tmp_path / "agent0.log").read_text()[-4000:]
    assert codes[0] == 0, f"surviving agent: {codes}\n{tail}"
    assert codes[1] != 0, codes  # SIGKILLed
    got = _read(tmp_path, 2)  # the restarted world: 2 ranks, both on nodeA
    ref, ref_rows = _uninterrupted()
    for rank, r in enumerate(got):
        assert r["attempt"] == "1" and r["host"] == "nodeA" and r["world"] == 2, (rank, r)
        # pp 2 x dp 2 with 2 micro-batches of 2 rows became pp 2 x dp 1 with 4 of 2 rows
        assert (r["dp"], r["num_microbatches"]) == (1, 4), r
        first = r["steps"][0]
        assert first == KILL_STEP and r["steps"] == list(range(first, 9)), r["steps"]
        assert [sorted(x) for x in r["rows"]] == ref_rows[first - 1 :], "other rows trained"
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(ref["losses"][first - 1 :]), rtol=0, atol=1e-5
        )
    params_got = {n: v for r in got for n, v in r["params"].items()}
    assert params_got.keys() == ref["params"].keys()
    for name, want in ref["params"].items():
        torch.testing.assert_close(params_got[name], want, rtol=0, atol=1e-5, msg=name)
    print(f"restarted on nodeA from step {first}: losses {got[0]['losses']}")


def test_a_pipeline_that_does_not_fit_the_smaller_world_is_refused_on_every_rank(
    tmp_path: Path,
) -> None:
    if (why := unavailable()) is not None:
        pytest.skip(why)
    params = {"out": str(tmp_path / "ckpt"), "pp_size": 4, "kill_step": 3}
    codes = run_agents("elastic_scenarios.shrink", params, tmp_path, timeout=600)
    assert codes[0] not in (0, "timeout"), codes
    logs = worker_logs(tmp_path, 0, attempt=1)
    assert sorted(logs) == [0, 1], logs.keys()
    for local, text in logs.items():
        error = next((ln for ln in text.splitlines() if "pp_size (4)" in ln), None)
        assert error is not None, (local, text[-3000:])
        print(f"nodeA local rank {local}: {error}")
        assert "the world has 2 processes" in error and "restart" in error, error


def test_a_script_keeping_its_per_rank_batch_is_refused_at_the_resume(tmp_path: Path) -> None:
    """Each rank's rows fixed at 4: on the restarted world the global batch would be 4 rows, not
    the checkpoint's 8, and skipping the epoch's trained batches would skip other rows."""
    if (why := unavailable()) is not None:
        pytest.skip(why)
    params = {"out": str(tmp_path / "ckpt"), "pp_size": 2, "kill_step": KILL_STEP, "fixed_rows": 4}
    codes = run_agents("elastic_scenarios.shrink", params, tmp_path, timeout=600)
    assert codes[0] not in (0, "timeout"), codes
    logs = worker_logs(tmp_path, 0, attempt=1)
    assert sorted(logs) == [0, 1], logs.keys()
    for local, text in logs.items():
        error = next((ln for ln in text.splitlines() if "global batch of 8 rows" in ln), None)
        assert error is not None, (local, text[-3000:])
        print(f"nodeA local rank {local}: {error}")
        assert "this run's global batch is 4 rows" in error, error


def test_torchrun_c10d_rendezvous_across_emulated_hosts_trains_like_one_process(
    tmp_path: Path,
) -> None:
    """Two agents, each in its host's network namespace (the rendezvous and gloo over the veth
    link between them), nodes numbered by the rendezvous (no --node-rank): each stage's shard
    group on one host, 3 steps equal to one process."""
    if (why := unavailable()) is not None:
        pytest.skip(why)
    case = {"id": "c10d", "layout": PIPE}
    with TwoLinks() as links:
        codes = run_agents(
            "hosts_scenarios.train", {"cases": [case]}, tmp_path, nnodes="2", max_restarts=0,
            links=links, timeout=420,
        )  # fmt: skip
    assert codes == [0, 0], f"{codes}\n{(tmp_path / 'agent0.log').read_text()[-3000:]}"
    got = _read(tmp_path, 4)
    hosts = [r["c10d"]["host"] for r in got]
    print(f"c10d numbering, rank -> host: {hosts}; layout: {got[0]['c10d']['lines'][-2:]}")
    assert sorted(hosts) == ["nodeA", "nodeA", "nodeB", "nodeB"], hosts
    assert all(len(group) == 1 for group in got[0]["c10d"]["group_hosts"]), got[0]["c10d"]
    assert_matches_reference(got, case)


def test_accelerate_launch_one_task_per_host_trains_like_one_process(tmp_path: Path) -> None:
    """`accelerate launch --multi_gpu --num_machines 2 --machine_rank k --num_processes 4
    --main_process_ip <host 0>` once per emulated host (its network namespace), an Accelerate
    loop through `prepare_pipeline` (AdamW, warm-up + cosine, clipping, validation): equal to one
    process, each stage's shard group on one host."""
    from tests.distributed.accelerate_scenarios import reference as acc_reference
    from tests.distributed.test_accelerate import LAYOUT, assert_matches

    if (why := unavailable()) is not None:
        pytest.skip(why)
    case = {"id": "acc-launch", "layout": LAYOUT, "validate": True}
    params = {"cases": [dict(case)], "init_process_group": False}
    with TwoLinks() as links:
        codes = run_agents(
            "accelerate_scenarios.run_cases", params, tmp_path, links=links, timeout=420,
            launcher="accelerate",
        )  # fmt: skip
    log = (tmp_path / "agent0.log").read_text()
    assert codes == [0, 0], f"{codes}\n{log[-3000:]}"
    got = [r["acc-launch"] for r in _read(tmp_path, 4)]
    assert_matches(got, acc_reference(**case))
    for line in ("pp rank 0 dp_shard groups: ranks [0, 1] on nodeA",
                 "pp rank 1 dp_shard groups: ranks [2, 3] on nodeB"):  # fmt: skip
        assert line in log, log[-3000:]


def test_hf_trainer_under_accelerate_launch_one_task_per_host_trains_like_one_process(
    tmp_path: Path,
) -> None:
    """`ZeroPPTrainer` (pp 2 x dp_shard 2, padded rows, clipping, accumulation 2) started by
    `accelerate launch` once per emulated host: loss, learning rate and gradient norm per logged
    step and the saved weights equal to the plain Trainer in one process."""
    from tests.distributed.launch import launch
    from tests.distributed.test_trainer import (
        CLIPPED,
        ONE,
        PP,
        _assert_same_training,
        _assert_same_weights,
    )

    if (why := unavailable()) is not None:
        pytest.skip(why)
    script = {"rows": "padded", "args": CLIPPED}
    case = {"id": "trainer", "plugin": PP, "script": script}
    params = {"cases": [case], "out_dir": str(tmp_path / "four")}
    with TwoLinks() as links:
        codes = run_agents(
            "trainer_scenarios.run", params, tmp_path, links=links, timeout=480,
            launcher="accelerate",
        )  # fmt: skip
    log = (tmp_path / "agent0.log").read_text()
    assert codes == [0, 0], f"{codes}\n{log[-3000:]}"
    got = _read(tmp_path, 4)[0]["trainer"]
    one_case = {"id": "trainer", "plugin": None, "script": {**script, **ONE}}
    params = {"cases": [one_case], "out_dir": str(tmp_path / "one")}
    one = launch(1, "trainer_scenarios.run", params, tmp_path / "one", timeout=480)[0]
    _assert_same_training(got, one["trainer"])
    _assert_same_weights(got, one["trainer"])
    assert "pp rank 0 dp_shard groups: ranks [0, 1] on nodeA" in log, log[-3000:]
