"""A network partition mid-training: ranks 0-1 and 2-3 on two emulated nodes (network namespaces,
`bench/netns.py`) whose link is cut; every rank exits within the timeout + 30 s, naming a rank of
the other side as lost (the store's side by the roll call, the other by its store calls'
deadline). Needs root and namespaces: slow, run by bench/slow_tests.py and bench/bench_faults.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.distributed.launch import ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _bench() -> object:
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(
        "bench_faults", ROOT / "bench" / "bench_faults.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", ["lightning_partition", "accelerate_partition"])
def test_a_partition_ends_every_rank_in_time_naming_the_other_side(tmp_path: Path, case: str):
    bench = _bench()  # puts bench/ on the path
    from netns import EmulatedCluster, unavailable

    if (why := unavailable()) is not None:
        pytest.skip(why)
    spec = bench._scenarios().PARTITIONS[case]
    with EmulatedCluster(2, 2, inter_mbit=None) as cluster:
        got = bench.fault_case(ROOT, case, spec, tmp_path, cluster)
    assert not got["hung"], got
    assert got["named_on_every_survivor"], got
    assert got["slowest_s"] < bench.TIMEOUT_S + 30, got
    print(f"{case}: every rank named the other side within {got['slowest_s']} s of the cut")
