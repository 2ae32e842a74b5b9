"""compile=True reproduces one eager process (fp32, 1e-5 in losses and parameters) in every
schedule: whole blocks compiled under those with a full backward, the regions between the weights
under those that split backward (ZBV, interleaved ZB, DualPipeV, ZeroPP; `core.shard.compile`);
and compiled code really ran, on every rank, in every case.

Compiling is slow on two loaded cores: CI runs ZeroPP (the library's own schedule, split
backward); the other schedules share one slow launch, where each rank compiles one graph per
mode and every later case reuses it.
"""

from __future__ import annotations

import pytest

from lightning_zeropp.core import ZeroPPConfig
from lightning_zeropp.core.shard.compile import splits_backward
from tests.distributed.conftest import assert_matches_reference
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed


def _case(id: str, **layout) -> dict:
    return {"id": id, "layout": {"compile": True, **layout}, "optimizer": "adamw", "split": "call"}


CI_CASES = [_case("pp2-zeropp", pp_size=2, schedule="zeropp", num_microbatches=4)]
SLOW_CASES = [
    _case("pp2-zbv", pp_size=2, schedule="zbv", num_microbatches=4),
    _case("pp2-1f1b", pp_size=2, schedule="1f1b", num_microbatches=4),
    _case("pp2-gpipe", pp_size=2, schedule="gpipe", num_microbatches=4),
    _case("pp2-interleaved", pp_size=2, schedule="interleaved_1f1b", num_microbatches=4),
    _case("pp2-interleaved_zb", pp_size=2, schedule="interleaved_zb", num_microbatches=4),
    _case("pp2-dualpipev", pp_size=2, schedule="dualpipev", num_microbatches=4),
    _case("pp2-zeropp-full-backward", pp_size=2, schedule="zeropp", split_backward=False),
    # recomputation runs the compiled forward again inside the checkpoint
    _case("pp2-zeropp-recompute", pp_size=2, schedule="zeropp", activation_checkpointing=True),
    _case("dp_shard2", dp_shard_size=2, num_microbatches=2),
]


@pytest.fixture(scope="module")
def ci_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile")
    return launch(2, "compile_scenarios.parity", {"cases": CI_CASES}, out, timeout=600)


@pytest.fixture(scope="module")
def slow_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile_slow")
    return launch(2, "compile_scenarios.parity", {"cases": SLOW_CASES}, out, timeout=900)


def _check(results: list, case: dict) -> None:
    assert_matches_reference(results, case)
    cfg = ZeroPPConfig(**case["layout"]).resolve(2)
    regions = splits_backward(cfg.schedule, cfg.split_backward)
    runs, other = ("split_runs", "whole_runs") if regions else ("whole_runs", "split_runs")
    for rank, result in enumerate(results):
        counts = result[case["id"]]["compile"]
        assert not counts.get("fallbacks"), (rank, counts)
        # every block of the rank's stages ran compiled in each micro-batch of the 3 steps
        blocks = 8 // cfg.pp_size
        least = 3 * cfg.num_microbatches * blocks
        assert counts.get(runs, 0) >= least and not counts.get(other), (rank, counts)


@pytest.mark.parametrize("case", CI_CASES, ids=lambda c: c["id"])
def test_compiled_blocks_match_one_eager_process(ci_results, case):
    _check(ci_results, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: c["id"])
def test_compiled_blocks_match_one_eager_process_in_every_schedule(slow_results, case):
    _check(slow_results, case)


# HF decoders through the Lightning front, cut at their block calls: Qwen3 normalizes queries and
# keys inside attention (scales read in the middle of a compiled region's neighbours), Llama not.
HF_CASES = [
    {"id": f"{family}-zbv", "family": family, "loss": "logits", "optimizer": "adamw"}
    for family in ("llama", "qwen3")
]
HF_LAYOUT = {
    "pp_size": 2,
    "schedule": "zbv",
    "num_microbatches": 4,
    "compile": True,
    "split": "call",
}


@pytest.fixture(scope="module")
def hf_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile_hf")
    cases = [{**c, "layout": HF_LAYOUT, "export_to": str(root / c["id"])} for c in HF_CASES]
    params = {"cases": cases, "init_process_group": False}
    return launch(2, "compile_scenarios.fit_hf_cases", params, root / "logs", timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("case", HF_CASES, ids=lambda c: c["id"])
def test_compiled_hf_decoders_under_lightning_match_one_process(hf_results, case):
    from tests.distributed.common import reference, sampler_batches
    from tests.distributed.hf_scenarios import make_hf_model, reference_loss

    ref = reference(
        "adamw", False, 3, batches=sampler_batches(3),
        model_fn=lambda: make_hf_model(case["family"]), loss_fn=reference_loss("logits"),
    )  # fmt: skip
    assert_matches_reference(
        hf_results, {**case, "layout": HF_LAYOUT}, "logged", batches=sampler_batches(3), ref=ref
    )
    for rank, result in enumerate(hf_results):
        counts = result[case["id"]]["compile"]
        assert counts.get("split_runs", 0) >= 3 * 4 * 2 and not counts.get("fallbacks"), (
            rank,
            counts,
        )
