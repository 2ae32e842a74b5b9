"""`Trainer(strategy=ZeroPPStrategy(...))` on an unmodified LightningModule matches one process.

Checked per layout: the loss rank 0 logs (and `training_step`'s returned loss) at every step, every
parameter after training, `gradient_clip_val` (global norm), `accumulate_grad_batches`, validation
through the forward-only schedule, and a resumed run against an uninterrupted one.
"""

from __future__ import annotations

import pytest
import torch

from lightning_zeropp.models import GPT
from tests.distributed.common import MODEL, lm_loss, make_batches, reference, sampler_batches
from tests.distributed.conftest import assert_matches_reference
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

CASES = [
    {
        "id": "pp2-dps2-1f1b-clip",
        "layout": {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 4},
        "split": "trace",  # the others take the default ("auto": a call split for LitGPT)
        "clip": True,
        "validate": True,
    },
    {
        "id": "pp2-dpr2-zbv-adamw-acc2",
        "layout": {"pp_size": 2, "dp_replicate_size": 2, "schedule": "zbv", "num_microbatches": 2},
        "optimizer": "adamw",
        "clip": True,
        "accumulate": 2,
    },
    {
        "id": "pp4-interleaved-stack",
        "layout": {"pp_size": 4, "schedule": "interleaved_1f1b", "num_microbatches": 4},
        "split": "stack",
        "direct": True,
        "validate": True,
    },
    {
        "id": "pp2-dps2-zeropp-unit-comms",
        "layout": {
            "pp_size": 2,
            "dp_shard_size": 2,
            "schedule": "zeropp",
            "num_microbatches": 4,
            "unit_size": 2,
            "grad_reduce": "unit",
            "log_comms": True,
        },
        "optimizer": "adamw",
        "clip": True,
    },
    {
        # LitGPT's loss through the head in chunks of 8 tokens (16 per row) on the last stage
        "id": "pp2-dps2-call-chunked-loss",
        "layout": {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 2, "loss_chunk": 8},
        "split": "call",
        "optimizer": "adamw",
    },
    {
        "id": "dps4-adamw",
        "layout": {"dp_shard_size": 4, "num_microbatches": 2},
        "optimizer": "adamw",
    },
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cases = [dict(c) for c in CASES]
    params = {"cases": cases, "init_process_group": False}
    return launch(
        4, "lightning_scenarios.fit_cases", params, tmp_path_factory.mktemp("lit"), timeout=420
    )


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_fit_matches_single_process(results, case):
    acc = case.get("accumulate", 1)
    steps = case.get("steps", 3)
    ref_case = {**case, "steps": steps * acc}
    batches = sampler_batches(steps * acc)
    # logged = the real per-batch loss on rank 0 (and on every rank)
    assert_matches_reference(results, ref_case, "logged", "model.", batches, acc)
    for rank_result in results:  # training_step's returned loss is Lightning's loss / accumulate
        got = torch.tensor(rank_result[case["id"]]["returned"]) * acc
        torch.testing.assert_close(
            got, torch.tensor(rank_result[case["id"]]["logged"]), rtol=0, atol=1e-6
        )


def test_logged_values_cross_the_pipeline_unpickled_after_the_first_step(results):
    """What is logged (names, arguments) crosses pickled once; each step's values as a tensor."""
    for case in CASES:
        pp = case["layout"].get("pp_size", 1)
        for r in results:
            assert r[case["id"]]["pickled_log_broadcasts"] == (1 if pp > 1 else 0), case["id"]


def test_comm_metrics_are_logged_as_the_mean_over_ranks(results):
    """`log_comms=True` logs the engine's per-step counts, averaged over ranks, on every rank."""
    case_id = "pp2-dps2-zeropp-unit-comms"
    per_rank = [r[case_id]["last_comms"] for r in results]
    want: dict[str, float] = {}
    for summary in per_rank:
        for kind, axes in summary.items():
            for axis, stats in axes.items():
                for field in ("count", "bytes"):
                    key = f"comm/{kind}/{axis}/{field}"
                    want[key] = want.get(key, 0.0) + stats[field] / len(per_rank)
    for r in results:
        assert r[case_id]["comms_logged"] == pytest.approx(want)
    for key in ("all_gather/dp_shard", "reduce_scatter/dp_shard", "send/pp", "recv/pp"):
        assert want[f"comm/{key}/bytes"] > 0, key


@pytest.mark.parametrize("case", [c for c in CASES if c.get("validate")], ids=lambda c: c["id"])
def test_validation_runs_forward_only_schedule(results, case):
    ref = reference(
        case.get("optimizer", "sgd"), case.get("clip", False), 3, batches=sampler_batches(3)
    )
    model = GPT(MODEL)
    model.load_state_dict(ref["params"])
    with torch.no_grad():  # val loader is not shuffled: batch k is rows [kB, (k+1)B)
        want = torch.stack([lm_loss(model(x), y) for x, y in make_batches(3)]).mean()
    for rank_result in results:
        torch.testing.assert_close(
            torch.tensor(rank_result[case["id"]]["val_loss"]), want, rtol=0, atol=1e-5
        )


def test_resumed_run_continues_exactly(tmp_path):
    layout = {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 2}
    params = {"layout": layout, "save_to": str(tmp_path / "ckpt"), "init_process_group": False}
    out = launch(4, "lightning_scenarios.resume", params, tmp_path / "run", timeout=420)
    assert (tmp_path / "ckpt" / "meta.pt").is_file()
    assert not list(tmp_path.glob(".ckpt.tmp-*"))  # written atomically: no temp dir left behind
    for rank_result in out:
        full, first, resumed = rank_result["full"], rank_result["first"], rank_result["resumed"]
        assert len(full["logged"]) == 6 and len(resumed["logged"]) == 3
        torch.testing.assert_close(
            torch.tensor(first["logged"]), torch.tensor(full["logged"][:3]), rtol=0, atol=1e-6
        )
        # the resumed module started from other weights (seed 7): only the checkpoint makes these equal
        torch.testing.assert_close(
            torch.tensor(resumed["logged"]), torch.tensor(full["logged"][3:]), rtol=0, atol=1e-6
        )
        for name, value in full["params"].items():
            torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=1e-6)
