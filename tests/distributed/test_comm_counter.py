"""CommCounter on 2 gloo ranks: the traffic of one engine step is what the model implies."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.distributed.comm_scenarios import MODEL
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

FP32 = 4


def _shard_numel(shape: tuple[int, ...], ws: int) -> int:
    """Elements of one rank's shard: FSDP2 pads dim 0 to a multiple of the shard count."""
    return math.ceil(shape[0] / ws) * math.prod(shape[1:])


def test_batch_isend_irecv_counts_every_op(tmp_path: Path) -> None:
    for result in launch(2, "comm_scenarios.batch_p2p", {}, tmp_path):
        # 3 fp32 + 5 fp64 each way; the op built before the counter started is counted too.
        expected = {"world": {"count": 2, "bytes": 3 * 4 + 5 * 8}}
        assert result["summary"] == {"send": expected, "recv": expected}
        assert result["received"] == [[1.0] * 3, [1.0] * 5]


def test_fsdp_step_traffic_is_on_dp_shard(tmp_path: Path) -> None:
    ws = 2
    results = launch(2, "comm_scenarios.engine_step", {"layout": {"dp_shard_size": ws}}, tmp_path)
    for result in results:
        summary, units = result["summary"], result["units"]
        assert len(units) == MODEL.num_layers + 1  # the blocks + the root (embeddings, norm, head)
        shard_bytes = sum(_shard_numel(s, ws) for unit in units for s in unit) * FP32
        # Each unit's gradients are reduce-scattered once per step, from the full padded size.
        assert summary["reduce_scatter"] == {
            "dp_shard": {"count": len(units), "bytes": ws * shard_bytes}
        }
        # With pp 1, weights are resharded after forward: every unit is gathered in forward and
        # again in backward, each time from this rank's padded shard.
        assert summary["all_gather"] == {
            "dp_shard": {"count": 2 * len(units), "bytes": 2 * shard_bytes}
        }
        # The loss, and the four int32 flags by which the ranks agree whether to rebuild the
        # step's schedule (a rebuild gathers weights, so all rebuild when any must), whether
        # every rank's batch passed its checks, whether some rank's step skips the batch, and
        # whether some rank received SIGTERM (then every rank stops before the step); and one
        # int32 flag per parameter by which the ranks agree which parameters have a gradient
        # before FSDP reduces them (an expert no row of a rank's batch reached has none).
        flags = sum(len(unit) for unit in units) * 4
        assert summary["all_reduce"] == {"dp_shard": {"count": 3, "bytes": FP32 + 16 + flags}}
        assert set(summary) == {"all_gather", "reduce_scatter", "all_reduce"}


def test_pipeline_step_traffic_is_on_pp(tmp_path: Path) -> None:
    m = 4
    layout = {"pp_size": 2, "num_microbatches": m}
    results = launch(2, "comm_scenarios.engine_step", {"layout": layout}, tmp_path)
    assert [r["stage_ids"] for r in results] == [[0], [1]]
    for result in results:
        summary = result["summary"]
        activation_bytes = math.prod(result["activation_shape"]) * FP32
        # Stage 0 sends m activations and receives m gradients; stage 1 the other way round.
        # Both have the shape of the hidden state between the stages.
        per_microbatch = {"pp": {"count": m, "bytes": m * activation_bytes}}
        assert summary["send"] == per_microbatch
        assert summary["recv"] == per_microbatch
        assert summary["broadcast"] == {"pp": {"count": 1, "bytes": FP32}}  # the loss
        # The step's four agreement flags (see above): SIGTERM on either stage stops both.
        assert summary["all_reduce"] == {"pp": {"count": 1, "bytes": 16}}
        # dp_shard has one rank: FSDP2 issues no collective, and nothing else crosses pp.
        assert set(summary) == {"send", "recv", "broadcast", "all_reduce"}
