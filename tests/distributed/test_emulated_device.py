"""The emulated device (bench/emulated_device.py) puts its waits where the plan puts them: a
GPipe step on 2 ranks takes its closed form, (M + p - 1)(F + B), every block launching its
forward, input-gradient and weight-gradient waits once per micro-batch; a ZeroPP step with
split backward takes what the planner's simulation of the same waits says."""

from __future__ import annotations

import pytest
import torch

from lightning_zeropp.core import ZeroPPConfig
from lightning_zeropp.models import GPT
from lightning_zeropp.plan import Hardware, predict_step_time
from lightning_zeropp.plan.memory import stage_ranges
from tests.distributed.common import MODEL
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

BLOCK_S = 0.025  # a block's forward; its input and weight gradients the same each
GPIPE = {"pp_size": 2, "schedule": "gpipe", "num_microbatches": 4}
ZEROPP = {"pp_size": 2, "schedule": "zeropp", "num_chunks": 2, "num_microbatches": 4}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("emulated")
    params = {"layouts": [GPIPE, ZEROPP], "forward_s": BLOCK_S}
    return launch(2, "emulated_scenarios.steps", params, out, timeout=300)


def _step(ranks: list[dict]) -> float:
    return max(r["end"] for r in ranks) - min(r["start"] for r in ranks)


def test_gpipe_takes_its_closed_form(results) -> None:
    gpipe = [r[0] for r in results]
    p, m, blocks = 2, 4, MODEL.num_layers // 2
    f, b = blocks * BLOCK_S, 2 * blocks * BLOCK_S  # a stage's forward and backward
    for r in gpipe:
        assert r["busy"] == pytest.approx(m * (f + b), rel=1e-9)
        kinds = [k for k, _, _ in r["spans"]]
        assert sorted(set(kinds)) == ["F", "I", "W"]
        assert [kinds.count(k) for k in "FIW"] == [m * blocks] * 3
        assert kinds[: m * blocks] == ["F"] * m * blocks  # GPipe: every forward first
    closed = (m + p - 1) * (f + b)
    assert closed * 0.98 <= _step(gpipe) <= closed * 1.2, (_step(gpipe), closed)
    # the last stage starts one stage-forward after the first (its input's wait)
    first = {r["pp_rank"]: r["spans"][0][1] for r in gpipe}
    assert first[1] - first[0] == pytest.approx(f, abs=0.05)


def test_zeropp_with_split_backward_takes_its_plan(results) -> None:
    zeropp = [r[1] for r in results]
    with torch.device("meta"):
        model = GPT(MODEL)
        for block in model.blocks:
            block.register_parameter("emulated_weight", torch.nn.Parameter(torch.zeros(1)))
    config = ZeroPPConfig(**ZEROPP)
    cut = stage_ranges(model, config.resolve(2))
    units = [[(0.0, 0.0), *[(BLOCK_S, 2 * BLOCK_S)] * len(r)] for r in cut]
    fast = Hardware(flops_per_s=1.0, intra_node_Bps=1e12, inter_node_Bps=1e12, node_size=2,
                    latency_s=0.0, overlap=True)  # fmt: skip
    plan = predict_step_time(model, config, 2, 16, MODEL.seq_len, fast, unit_seconds=units,
                             optimizer_seconds=0.0)  # fmt: skip
    busy = {r["pp_rank"]: r["busy"] for r in zeropp}
    assert busy == pytest.approx({r: line.compute for r, line in plan.ranks.items()}, rel=1e-9)
    assert plan.step_s * 0.98 <= _step(zeropp) <= plan.step_s * 1.15, (_step(zeropp), plan.step_s)
    assert zeropp[0]["loss"] == pytest.approx(results[0][0]["loss"], rel=1e-6)  # same numbers
