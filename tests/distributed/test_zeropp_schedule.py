"""schedule="zeropp": exact against one process, and the collectives that really ran match the design.

Parity for (pp, v, M, U) in (2,2,4,2), (2,2,8,4), (4,2,8,4), (2,2,6,4) and (2,2,7,3), each with the
gradients reduce-scattered per step, per unit and per micro-batch: the last two end in a smaller
unit, the second in one smaller than pp. All run the split backward (held-back weight-gradient
tasks on released chunks included); one runs without it and one with ZeroPP's recompute policy.
Collectives are counted during the second step (the first also runs the runtime's shape inference).
"""

from __future__ import annotations

import pytest

from lightning_zeropp.core import ZeroPPConfig
from lightning_zeropp.core.schedule.build import zeropp_orders
from lightning_zeropp.core.schedule.zeropp import gather_blocks, units
from tests.distributed.conftest import (
    assert_matches_reference,
    by_world,
    core_results_by_world,
    slow_case,
)

pytestmark = pytest.mark.distributed

TIMINGS = ("step", "unit", "microbatch")


def _case(pp: int, v: int, m: int, u: int, batch: int, optimizer: str = "sgd", **layout):
    layout = dict(
        pp_size=pp, num_chunks=v, num_microbatches=m, unit_size=u, schedule="zeropp", **layout
    )
    name = f"pp{pp}-v{v}-M{m}-U{u}" + "".join(
        f"-{k}{w}" for k, w in layout.items() if k.startswith(("dp", "grad", "split", "act"))
    )
    return {
        "id": name,
        "layout": layout,
        "optimizer": optimizer,
        "clip": True,
        "global_batch": batch,
        "count_comms": True,
    }


def _timings(*args, **kwargs) -> list[dict]:
    return [_case(*args, grad_reduce=t, **kwargs) for t in TIMINGS]


def _step_timing(*args, **kwargs) -> list:
    """The three timings, with "unit" and "microbatch" left to the slow run (the first units'
    rows and SHARDED check every timing in CI)."""
    step, *others = _timings(*args, **kwargs)
    return [step, *(slow_case(c) for c in others)]


# (pp, v, M, U) = (2, 2, 4, 2) with AdamW on pp 2 x dp_shard 2: where the collectives are counted
SHARDED = _timings(2, 2, 4, 2, 16, "adamw", dp_shard_size=2)
CASES = {
    2: [
        *_timings(2, 2, 4, 2, 16),
        *_step_timing(2, 2, 8, 4, 16, "adamw"),
        *_step_timing(2, 2, 6, 4, 12),
        *_step_timing(2, 2, 7, 3, 14),
        _case(2, 2, 8, 4, 16, split_backward=False),
        _case(2, 2, 8, 4, 16, activation_checkpointing="except_last"),
    ],
    4: [
        *_step_timing(4, 2, 8, 4, 16),
        *SHARDED,
    ],
}
ALL = by_world(CASES)


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    return core_results_by_world(tmp_path_factory, CASES, "zeropp", request)


@pytest.mark.parametrize(("world", "case"), ALL)
def test_zeropp_matches_single_process(results, world, case):
    assert_matches_reference(results(world), case)


def _sharded(results, timing: str) -> tuple[dict, list[dict]]:
    case = next(c for c in SHARDED if c["layout"]["grad_reduce"] == timing)
    outs = [rank_result[case["id"]] for rank_result in results(4)]
    return case, outs


def test_gathers_follow_units_not_microbatches(results):
    """Per step each rank gathers each chunk once per block: 2v-1 per unit (blocks that meet across
    units share one), counted from the all-gathers that ran on the dp_shard axis. Held-back
    weight-gradient tasks run on released chunks and add none."""
    case, outs = _sharded(results, "step")
    config = ZeroPPConfig(**case["layout"]).resolve(4)
    v, n_units = config.num_chunks, len(units(config.num_microbatches, config.unit_size))
    orders = zeropp_orders(config)
    assert any(t.kind == "W" for t in orders[1][-2:])  # rank 1 does hold W's back
    for rank, out in enumerate(outs):
        blocks = gather_blocks(orders[rank // config.dp_shard_size])
        assert len(blocks) == n_units * (2 * v - 1) - (n_units - 1)
        want = sum(out["plan"][stage] for stage, _, _ in blocks)
        got = out["comms"][1]["all_gather"]["dp_shard"]["count"]
        assert got == want, f"rank {rank}: {got} all-gathers, the design implies {want}"


@pytest.mark.parametrize("timing", TIMINGS)
def test_reduce_scatters_follow_the_timing(results, timing):
    """Per step, each FSDP unit of each local stage reduce-scatters once ("step"), once per unit,
    or once per micro-batch, counted from the reduce-scatters that ran."""
    case, outs = _sharded(results, timing)
    config = ZeroPPConfig(**case["layout"]).resolve(4)
    times = {
        "step": 1,
        "unit": len(units(config.num_microbatches, config.unit_size)),
        "microbatch": config.num_microbatches,
    }[timing]
    for rank, out in enumerate(outs):
        want = times * sum(out["plan"].values())
        got = out["comms"][1]["reduce_scatter"]["dp_shard"]["count"]
        assert got == want, f"rank {rank}: {got} reduce-scatters with {timing=}, expected {want}"
