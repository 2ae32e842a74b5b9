"""Perplexity and token accuracy on 4 gloo ranks equal one process's values.

Through both fronts' mechanisms: the Lightning front (LitGPT's `validation_step` runs on the last
stage per micro-batch; `on_validation_epoch_end` computes on every rank) and the core engine with
metrics updated in the loss function (what the Accelerate recipe does). Layouts: the main job's
pp 2 x dp_shard 2, two chunks per rank with replicas (data-parallel over dp_replicate), and the
zeropp schedule. (A V schedule, whose last stage sits on pipeline rank 0, is left out: validating
it before any training step fails inside torch's runtime, "can't steal_bwd_input if this stage
doesn't have backward".)
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_zeropp.metrics import CausalLMMetrics
from tests.distributed import metrics_scenarios as scenarios
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

CASES = [
    {
        "id": "lightning-pp2-dps2-1f1b",
        "front": "lightning",
        "layout": {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 4},
    },
    {
        "id": "lightning-pp2-dpr2-interleaved",
        "front": "lightning",
        "layout": {
            "pp_size": 2,
            "dp_replicate_size": 2,
            "schedule": "interleaved_1f1b",
            "num_microbatches": 2,
        },
    },
    {
        "id": "engine-pp2-dps2-zeropp",
        "front": "engine",
        "layout": {"pp_size": 2, "dp_shard_size": 2, "schedule": "zeropp", "num_microbatches": 4},
    },
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    params = {"cases": [dict(c) for c in CASES], "init_process_group": False}
    out = tmp_path_factory.mktemp("metrics")
    return launch(4, "metrics_scenarios.run_cases", params, out, timeout=300)


@pytest.fixture(scope="module")
def reference():
    ref = scenarios.reference()
    # The data must tell a token-weighted value from a mean of micro-batch values.
    assert abs(ref["naive_perplexity"] - ref["perplexity"]) > 1e-3 * ref["perplexity"]
    return ref


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_distributed_metrics_match_one_process(results, reference, case):
    prefix = "val_" if case["front"] == "lightning" else ""
    for rank, rank_result in enumerate(results):
        got = rank_result[case["id"]]
        # Perplexity is exp(mean NLL): 1e-5 relative = 1e-5 absolute on the mean NLL.
        assert math.isclose(got[prefix + "perplexity"], reference["perplexity"], rel_tol=1e-5), (
            f"rank {rank}: {got} vs {reference}"
        )
        assert math.isclose(
            got[prefix + "token_accuracy"], reference["token_accuracy"], abs_tol=1e-5
        ), f"rank {rank}: {got} vs {reference}"
    if case["front"] == "engine":
        # Only the last stage's ranks (one per data-parallel rank) updated; the others took part
        # in compute() with empty states and still got the full value.
        updated = [r[case["id"]]["updated_here"] for r in results]
        assert sorted(updated) == [0.0, 0.0, 1.0, 1.0], updated


def test_single_process_metrics_and_empty_state():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    targets = torch.randint(0, 11, (3, 5))
    targets[0, :4] = -100
    metrics = CausalLMMetrics(11, prefix="val_")
    assert math.isnan(metrics.compute()["val_perplexity"])  # nothing seen: no value, no crash
    metrics.update(logits[:1], targets[:1])
    metrics.update(logits[1:], targets[1:])
    keep = targets != -100
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, 11), targets.reshape(-1), ignore_index=-100, reduction="sum"
    )
    values = metrics.compute()
    assert math.isclose(values["val_perplexity"], float(torch.exp(nll / keep.sum())), rel_tol=1e-6)
    acc = ((logits.argmax(-1) == targets) & keep).sum() / keep.sum()
    assert math.isclose(values["val_token_accuracy"], float(acc), abs_tol=1e-7)
    metrics.reset()
    assert math.isnan(metrics.compute()["val_perplexity"])
    assert not metrics.perplexity.dist_sync_on_step  # a per-step sync would hang other stages
    with pytest.raises(ValueError, match="expected logits"):
        metrics.update(logits[0], targets[0])
