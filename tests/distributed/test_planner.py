"""The planner's memory per rank against what CPU runs allocate: model state to the byte (the
issue asks for 5%; it is exact arithmetic, so anything less than exact is a bug), gathered
weights within 5%, steady-state saved activations within 2% (3% with recomputation; the issue
asks 15%), and each
step's all-gathers, reduce-scatters, sends and receives (calls and bytes) exactly as counted."""

from __future__ import annotations

import pytest
import torch

from lightning_zeropp.core import ZeroPPConfig
from lightning_zeropp.models import GPT
from lightning_zeropp.models.hf import build_causal_lm
from lightning_zeropp.plan import activation_peaks, predict_comm, predict_memory
from lightning_zeropp.plan.peaks import gradient_buffers
from tests.distributed.conftest import selected_values
from tests.distributed.launch import launch
from tests.distributed.plan_scenarios import GLOBAL_BATCH, LLAMA, MODEL

pytestmark = pytest.mark.distributed

LAYOUTS = [
    {"dp_shard_size": 4},
    {"dp_shard_size": 4, "num_microbatches": 2},
    {
        "pp_size": 2,
        "dp_shard_size": 2,
        "schedule": "zeropp",
        "num_microbatches": 8,
        "unit_size": 4,
        "grad_reduce": "unit",
    },
    {"pp_size": 2, "dp_shard_size": 2, "schedule": "zbv", "num_microbatches": 4},
    {"pp_size": 2, "dp_shard_size": 2, "schedule": "gpipe", "num_microbatches": 4},
    {
        "pp_size": 2,
        "dp_shard_size": 2,
        "schedule": "zeropp",
        "num_microbatches": 8,
        "unit_size": 4,
        "split_backward": False,
    },
    {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 2},
    {"pp_size": 2, "dp_shard_size": 2, "schedule": "interleaved_1f1b", "num_microbatches": 2},
    {"pp_size": 2, "dp_shard_size": 2, "schedule": "zeropp", "num_microbatches": 4},
    {"pp_size": 2, "dp_replicate_size": 2, "num_microbatches": 2, "param_dtype": "bf16"},
    {"pp_size": 4, "num_microbatches": 4},
    {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 4, "activation_checkpointing": True},
    {
        "pp_size": 2,
        "dp_shard_size": 2,
        "schedule": "zeropp",
        "num_microbatches": 4,
        "activation_checkpointing": "except_last",
    },
    {"dp_shard_size": 4, "activation_checkpointing": True},
    {"model": "llama", "pp_size": 2, "dp_shard_size": 2, "num_microbatches": 4},
    {
        "model": "llama",
        "pp_size": 2,
        "dp_shard_size": 2,
        "schedule": "zeropp",
        "num_microbatches": 4,
    },
    {"model": "llama", "dp_shard_size": 4, "num_microbatches": 2},
]


# ZeRO++ (4 ranks in nodes of 2): its traffic is predicted exactly too
PLUS = [
    {"dp_shard_size": 4, "num_microbatches": 2, "node_size": 2, "quantized_weights": "int8",
     "quantized_gradients": "int4", "hpz_partition_size": 2},
    {"pp_size": 2, "dp_shard_size": 2, "schedule": "zeropp", "num_microbatches": 4,
     "node_size": 1, "quantized_weights": "bf16", "quantized_gradients": "int8"},
]  # fmt: skip


def _model(layout: dict) -> torch.nn.Module:
    with torch.device("meta"):
        if layout.get("model") == "llama":
            return build_causal_lm("llama", **LLAMA)
        return GPT(MODEL)


def _config(layout: dict) -> ZeroPPConfig:
    return ZeroPPConfig(**{k: v for k, v in layout.items() if k != "model"})


# Layouts whose figures other rows check in CI (FSDP with micro-batches, ZeroPP without split
# backward and with except_last recompute, interleaved at 2 micro-batches, the Llama under
# ZeroPP): measured in the slow run only.
SLOW = {1, 5, 7, 12, 15}


def _indices(layouts: list[dict]) -> list:
    return [
        pytest.param(i, id=str(x), marks=[pytest.mark.slow] if i in SLOW else [])
        for i, x in enumerate(layouts)
    ]


@pytest.fixture(scope="module")
def measured(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[int, dict]]:
    """Per rank, each measured layout's figures by its index in LAYOUTS + PLUS: the layouts this
    session's selected tests read (a slow one only when one of its tests runs)."""
    out = tmp_path_factory.mktemp("planner")
    everything = LAYOUTS + PLUS
    chosen = selected_values(request, "index")
    run = [i for i in range(len(everything)) if i not in SLOW or i in chosen]
    ranks = launch(4, "plan_scenarios.measure", {"layouts": [everything[i] for i in run]}, out)
    return [dict(zip(run, rank, strict=True)) for rank in ranks]


@pytest.mark.parametrize("index", _indices(LAYOUTS))
def test_memory_per_rank_is_predicted(measured, index: int) -> None:
    model = _model(LAYOUTS[index])
    predicted = predict_memory(model, _config(LAYOUTS[index]), 4, device_type="cpu")
    for rank, ranks in enumerate(measured):
        got, want = ranks[index], predicted[rank]
        for key in ("parameters", "gradients", "optimizer_state"):
            assert getattr(want, key) == got[key], (rank, key)
        assert want.gathered_peak == pytest.approx(got["gathered_peak"], rel=0.05), rank


@pytest.mark.parametrize("index", _indices(LAYOUTS))
def test_activation_peaks_are_predicted(measured, index: int) -> None:
    layout = LAYOUTS[index]
    model = _model(layout)
    config = _config(layout).resolve(4)
    # saved-tensor tracking does not see a recomputing block's transient activations
    peaks = activation_peaks(
        model, _config(layout), 4, GLOBAL_BATCH, MODEL.seq_len, transients=False
    )
    for rank, ranks in enumerate(measured):
        want = peaks[rank // config.dp_size]
        # recomputation: torch's checkpoint keeps a little of its own beside the block inputs
        rel = 0.03 if config.activation_checkpointing != "none" else 0.02
        assert want == pytest.approx(ranks[index]["activation_peak"], rel=rel), rank


@pytest.mark.parametrize("index", _indices(LAYOUTS + PLUS))
def test_step_communication_is_predicted(measured, index: int) -> None:
    layout = (LAYOUTS + PLUS)[index]
    predicted = predict_comm(_model(layout), _config(layout), 4, GLOBAL_BATCH, MODEL.seq_len)
    kinds = ("all_gather", "reduce_scatter", "all_to_all", "send", "recv")
    for rank, ranks in enumerate(measured):
        got = {k: v for k, v in ranks[index]["comm"].items() if k in kinds}
        assert got == predicted[rank], rank


@pytest.mark.parametrize("index", _indices(LAYOUTS))
def test_gradient_buffers_are_predicted(measured, index: int) -> None:
    layout = LAYOUTS[index]
    config = _config(layout).resolve(4)
    predicted = gradient_buffers(_model(layout), config)
    for rank, ranks in enumerate(measured):
        got, want = ranks[index]["gradient_peak"], predicted[rank // config.dp_size]
        assert want == pytest.approx(got, rel=0.05), rank
