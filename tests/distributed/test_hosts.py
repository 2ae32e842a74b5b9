"""Ranks numbered across hosts (SLURM's cyclic distribution: rank r on host r % 2), on two emulated
hosts (a UTS namespace each, `hosts_cluster.py`): every dp_shard group and hpZ partition sits on
one host and training equals one process (1e-5); a pipeline link cut at setup is named on every
rank within the groups' timeout. Needs root: skipped without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.common import sampler_batches
from tests.distributed.conftest import assert_matches_reference
from tests.distributed.hosts_cluster import TwoLinks, launch_on_hosts, unavailable

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CYCLIC = [0, 1, 0, 1]  # rank -> host: SLURM --distribution=cyclic over 2 nodes x 2 tasks
PIPE = {"pp_size": 2, "dp_shard_size": 2, "schedule": "1f1b", "num_microbatches": 2}
HPZ = {"dp_shard_size": 4, "node_size": 2, "hpz_partition_size": 2, "reshard_after_forward": True}
CASES = [
    {"id": "pp2-dps2", "layout": PIPE},
    {"id": "pp2-dps2-numbered", "layout": PIPE, "rank_numbered": True},
    {"id": "dps4-hpz2", "layout": HPZ},
]
LINK_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def cyclic(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    if (why := unavailable()) is not None:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("hosts_cyclic")
    return launch_on_hosts(CYCLIC, "hosts_scenarios.train", {"cases": CASES}, out, timeout=600)


def test_each_rank_runs_on_its_emulated_host(cyclic: list[dict]) -> None:
    assert [r["pp2-dps2"]["host"] for r in cyclic] == ["nodeA", "nodeB", "nodeA", "nodeB"]


def test_cyclic_numbering_puts_every_shard_group_on_one_host(cyclic: list[dict]) -> None:
    got = cyclic[0]["pp2-dps2"]
    assert got["order"] == [0, 2, 1, 3]
    assert got["group_hosts"] == [["nodeA"], ["nodeB"]]
    assert "  pp rank 0 dp_shard groups: ranks [0, 2] on nodeA" in got["lines"], got["lines"]
    assert "  pp rank 1 dp_shard groups: ranks [1, 3] on nodeB" in got["lines"], got["lines"]
    # As numbered, each group would straddle the hosts (what the library did before).
    assert cyclic[0]["pp2-dps2-numbered"]["group_hosts"] == [["nodeA", "nodeB"]] * 2


def test_a_group_larger_than_a_host_spans_two_whole_hosts_and_hpz_stays_on_one(
    cyclic: list[dict],
) -> None:
    got = cyclic[0]["dps4-hpz2"]
    assert got["order"] == [0, 2, 1, 3] and got["group_hosts"] == [["nodeA", "nodeB"]]
    assert any("spans 2 whole hosts" in line for line in got["lines"]), got["lines"]
    assert got["partition_hosts"] == [["nodeA"], ["nodeB"]]  # backward gathers stay in a host


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_cyclic_numbering_trains_like_one_process(cyclic: list[dict], case: dict) -> None:
    assert_matches_reference(cyclic, case)


def test_host_aware_placement_sends_fewer_bytes_across_hosts(cyclic: list[dict]) -> None:
    placed = sum(r["pp2-dps2"]["sent"]["cross_node"] for r in cyclic)
    numbered = sum(r["pp2-dps2-numbered"]["sent"]["cross_node"] for r in cyclic)
    print(f"cross-host bytes per step, cyclic numbering: as numbered {numbered:,.0f}, "
          f"by host {placed:,.0f}")  # fmt: skip
    assert placed < numbered / 4, (placed, numbered)


def test_a_pipeline_link_cut_at_setup_is_named_on_every_rank(tmp_path: Path) -> None:
    if (why := unavailable()) is not None:
        pytest.skip(why)
    with TwoLinks() as links:
        params = {
            "layout": PIPE,
            "device": links.data_dev(1),
            "timeout_s": LINK_TIMEOUT_S,
            "init_process_group": False,
        }
        got = launch_on_hosts(
            CYCLIC, "hosts_scenarios.cut_link", params, tmp_path, timeout=300, links=links,
            extra_env={1: {"LZPP_CUT_HERE": "1"}},
        )  # fmt: skip
    for rank, result in enumerate(got):
        error = result["error"] or ""
        print(f"rank {rank} on {result['host']} after {result['seconds']:.1f} s: "
              f"{error.splitlines()[0] if error else None}")  # fmt: skip
        assert "the pipeline link between rank" in error, (rank, error)
        assert "host nodeA" in error and "host nodeB" in error, (rank, error)
        assert result["seconds"] < LINK_TIMEOUT_S + 30, (rank, result["seconds"])


def test_lightning_under_srun_with_cyclic_tasks_trains_like_one_process(tmp_path: Path) -> None:
    if (why := unavailable()) is not None:
        pytest.skip(why)
    params = {"layout": PIPE, "init_process_group": False}
    got = launch_on_hosts(
        CYCLIC, "hosts_scenarios.slurm_fit", params, tmp_path, timeout=600, launcher="slurm"
    )
    assert {r["environment"] for r in got} == {"SLURMEnvironment"}
    assert [r["host"] for r in got] == ["nodeA", "nodeB", "nodeA", "nodeB"]
    assert got[0]["group_hosts"] == [["nodeA"], ["nodeB"]]
    assert got[0]["node_size"] == 2  # from SLURM_NTASKS_PER_NODE
    case = {"id": "slurm", "steps": 3}
    results = [{"slurm": r} for r in got]
    assert_matches_reference(results, case, "logged", "model.", sampler_batches(3))


def test_hosts_that_cannot_hold_the_shard_groups_are_refused_on_every_rank(tmp_path: Path):
    if (why := unavailable()) is not None:
        pytest.skip(why)
    uneven = [0, 0, 1, 0]  # 3 ranks on nodeA, 1 on nodeB
    got = launch_on_hosts(uneven, "hosts_scenarios.refused", {"layout": PIPE}, tmp_path)
    for rank, result in enumerate(got):
        assert (result["error"] or "").startswith("PlacementError: dp_shard groups of 2"), rank
        assert "(nodeA: 3, nodeB: 1) ranks" in result["error"], (rank, result["error"])
    print(got[0]["error"])


def test_accelerate_front_with_cyclic_ranks_trains_like_one_process(tmp_path: Path) -> None:
    from tests.distributed.accelerate_scenarios import reference
    from tests.distributed.test_accelerate import LAYOUT, assert_matches

    if (why := unavailable()) is not None:
        pytest.skip(why)
    case = {"id": "acc-cyclic", "layout": LAYOUT, "validate": True}
    params = {"cases": [dict(case)], "init_process_group": False}
    got = launch_on_hosts(CYCLIC, "accelerate_scenarios.run_cases", params, tmp_path, timeout=600)
    assert_matches([r["acc-cyclic"] for r in got], reference(**case))
    log = (tmp_path / "rank0.log").read_text()
    assert "pp rank 0 dp_shard groups: ranks [0, 2] on nodeA" in log, log[-3000:]
