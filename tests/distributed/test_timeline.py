"""`StepRecorder` on a real ZeroPP step (pp 2 x dp_shard 2): what it records is what ran."""

from __future__ import annotations

import pytest

from lightning_zeropp.core import ZeroPPConfig
from lightning_zeropp.core.measure.timeline import Timeline, bubble_fraction
from lightning_zeropp.core.schedule.build import zeropp_orders
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

LAYOUT = dict(
    schedule="zeropp", pp_size=2, dp_shard_size=2, num_chunks=2, num_microbatches=4, unit_size=2
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("timeline")
    return launch(4, "timeline_scenarios.record", {"layout": LAYOUT}, out, timeout=300)


def test_compute_intervals_follow_the_planned_order(results):
    orders = zeropp_orders(ZeroPPConfig(**LAYOUT).resolve(4))
    for r in results:
        timeline = Timeline.from_dict(r["timeline"])
        got = [
            f"{i.stage}{i.kind}{i.microbatch}" for i in timeline.intervals if i.lane == "compute"
        ]
        assert got == [str(t) for t in orders[r["pp_rank"]]]
        assert all(i.end >= i.start >= 0 for i in timeline.intervals)
    assert 0 < bubble_fraction(Timeline.from_dict(r["timeline"]) for r in results) < 1


def test_comm_lane_and_peak_gathered_weights(results):
    for r in results:
        timeline = Timeline.from_dict(r["timeline"])
        gathers = [i for i in timeline.intervals if i.kind == "all_gather" and i.axis == "dp_shard"]
        assert len(gathers) == r["all_gathers"] > 0
        # One chunk gathered at a time: the peak is the largest chunk, never two chunks together.
        assert timeline.peak_unsharded_bytes == max(r["chunk_bytes"].values())
        assert timeline.peak_activation_bytes > 0
