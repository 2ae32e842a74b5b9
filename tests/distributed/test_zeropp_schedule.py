"""schedule="zeropp": exact against one process, and the gathers that really ran match the design.

Parity for (pp, v, M, U) in (2,2,4,2), (2,2,8,4), (4,2,8,4), (2,2,6,4) and (2,2,7,3): the last two
end in a smaller unit, the second in one smaller than pp. Gathers are counted from the all-gathers
FSDP issued during the second step (the first also runs the runtime's shape inference).
"""

from __future__ import annotations

import pytest

from lightning_zeropp.core.zeropp_schedule import gather_blocks, rank_order
from tests.distributed.conftest import assert_matches_reference, core_results_by_world

pytestmark = pytest.mark.distributed


def _case(pp: int, v: int, m: int, u: int, batch: int, optimizer: str = "sgd", **layout):
    layout = dict(
        pp_size=pp, num_chunks=v, num_microbatches=m, unit_size=u, schedule="zeropp", **layout
    )
    name = f"pp{pp}-v{v}-M{m}-U{u}" + "".join(
        f"-{k}{w}" for k, w in layout.items() if k.startswith("dp")
    )
    return {
        "id": name,
        "layout": layout,
        "optimizer": optimizer,
        "clip": True,
        "global_batch": batch,
    }


CASES = {
    2: [
        _case(2, 2, 4, 2, 16),
        _case(2, 2, 8, 4, 16, "adamw"),
        _case(2, 2, 6, 4, 12),
        _case(2, 2, 7, 3, 14),
    ],
    4: [
        _case(4, 2, 8, 4, 16),
        _case(2, 2, 4, 2, 16, "adamw", dp_shard_size=2),
    ],
}
ALL = [(w, c) for w, cases in CASES.items() for c in cases]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    counted = {w: [{**c, "count_comms": True} for c in cases] for w, cases in CASES.items()}
    return core_results_by_world(tmp_path_factory, counted, "zeropp")


@pytest.mark.parametrize(("world", "case"), ALL, ids=[f"w{w}-{c['id']}" for w, c in ALL])
def test_zeropp_matches_single_process(results, world, case):
    assert_matches_reference(results(world), case)


def test_gathers_follow_units_not_microbatches(results):
    """Per step each rank gathers each chunk once per block: 2v-1 per unit (blocks that meet across
    units share one), counted from the all-gathers that ran on the dp_shard axis."""
    case = CASES[4][-1]
    layout = case["layout"]
    pp, v, m, u = (layout[k] for k in ("pp_size", "num_chunks", "num_microbatches", "unit_size"))
    for rank, rank_result in enumerate(results(4)):
        out = rank_result[case["id"]]
        pp_rank = rank // layout["dp_shard_size"]
        blocks = gather_blocks(rank_order(pp_rank, pp, v, m, u))
        assert len(blocks) == 2 * (2 * v - 1) - 1  # M/U = 2 units
        want = sum(out["plan"][stage] for stage, _, _ in blocks)
        got = out["comms"][1]["all_gather"]["dp_shard"]["count"]
        assert got == want, f"rank {rank}: {got} all-gathers, the design implies {want}"
