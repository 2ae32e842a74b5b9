"""On one CUDA device (skipped without one; `bench/gpu/run.sh` runs them on a lent GPU): every
schedule, eager and compile=True (inductor's Triton kernels), against one CPU process.

One rank holds all stages (pp_size 1, two chunks for the multi-stage schedules): the machines
lent have one GPU, and NCCL refuses two ranks on one device.
"""

from __future__ import annotations

import os

import pytest
import torch

from lightning_zeropp.core import ZeroPPConfig
from lightning_zeropp.core.settings.placement import splits_backward
from tests.distributed.common import reference
from tests.distributed.launch import launch

# LZPP_GPU_DRY_RUN=1 (`GPU_DRY_RUN=1 bench/gpu/run.sh`) runs them on the CPU: a rehearsal.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(
        DEVICE == "cpu" and os.environ.get("LZPP_GPU_DRY_RUN") != "1", reason="needs a CUDA device"
    ),
]

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev", "zeropp"]
# reshard_after_forward=False, pipeline parallelism's default (pp_size 1 defaults to FSDP's True,
# under which the split-backward schedules lose the weight gradients of the tasks they split: the
# input-gradient task finds the weights resharded).
LAYOUT = {"pp_size": 1, "num_microbatches": 4, "reshard_after_forward": False}
CASES = [{"id": s, "layout": {**LAYOUT, "schedule": s}} for s in SCHEDULES]
# fp32 without TF32; cuBLAS, Triton and the CPU sum in other orders (an unchecked margin: no GPU
# has run these yet)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    return launch(1, "gpu_scenarios.compile_parity", _params(DEVICE), out, timeout=600)[0]


def _params(device: str) -> dict:
    return {"device": device, "cases": CASES, "init_process_group": False}


@pytest.fixture(scope="module")
def ref():
    return reference("adamw", clip=False, steps=3)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["id"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_every_schedule_on_one_gpu_matches_one_cpu_process(results, ref, case, compiled):
    got = results[(case["id"], compiled)]
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=TOLERANCE
    )
    assert got["params"].keys() == ref["params"].keys()
    for name, want in ref["params"].items():
        torch.testing.assert_close(got["params"][name], want, rtol=0, atol=TOLERANCE)
    counts = got["compile"]
    if not compiled:
        assert not counts.get("graphs"), counts
        return
    cfg = ZeroPPConfig(**case["layout"]).resolve(1)
    runs = "split_runs" if splits_backward(cfg.schedule, cfg.split_backward) else "whole_runs"
    assert counts.get(runs, 0) >= 3 * 4 * 8 and not counts.get("fallbacks"), counts


def test_a_model_built_on_the_gpu_is_checked_where_its_weights_are():
    """split='call' checks how a model calls its blocks with a dry run on one example batch; an HF
    model built on the GPU (`with torch.device("cuda")`, as `bench/gpu/bench_1b.py` does) gets its
    example from the loader in host memory. Its real dry run failed with "Expected all tensors to
    be on the same device" (bench_1b's zeropp_split rows, on an H200): it must run on the GPU."""
    from lightning_zeropp.core.split.blocks import plan_blocks
    from lightning_zeropp.core.split.call_plan import plan_calls
    from lightning_zeropp.models.hf import build_causal_lm

    with torch.device(DEVICE):
        model = build_causal_lm(
            "llama", seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
        )  # fmt: skip
    ids = torch.randint(0, 64, (2, 8))  # in host memory, as a DataLoader yields it
    plan = plan_calls(model, plan_blocks(model, 2), (ids,), {})
    assert plan.blocks.names == [str(i) for i in range(4)] and plan.last_units
