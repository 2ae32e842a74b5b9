"""Context parallelism (cp_size > 1) through each front reproduces one process: loss at every
step (returned and logged), every parameter after clipping, and the validation loss, within 1e-5,
on 4 gloo ranks in one launch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.common import lm_loss, make_batches, make_model, reference, sampler_batches
from tests.distributed.conftest import merged_params
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

LIGHTNING = [
    {"id": "lightning-gpt-pp2-cp2", "layout": {"pp_size": 2, "cp_size": 2, "num_microbatches": 2}},
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: Any) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("context_fronts")
    params = {"lightning": [dict(c) for c in LIGHTNING]}
    return launch(4, "context_front_scenarios.run", params, out, timeout=900)


def _close(got: Any, want: Any, what: str) -> None:
    torch.testing.assert_close(
        torch.as_tensor(got, dtype=torch.float64),
        torch.as_tensor(want, dtype=torch.float64),
        rtol=0,
        atol=1e-5,
        msg=lambda m: f"{what}: {m}",
    )


@pytest.mark.parametrize("case", LIGHTNING, ids=lambda c: c["id"])
def test_lightning_trainer_with_an_unmodified_module_matches_one_process(results, case):
    # Lightning's DistributedSampler shuffles the training rows (seeded by epoch): one
    # permutation split over the data-parallel ranks, read alike by the CP ranks of each.
    ref = reference("adamw", True, 3, batches=sampler_batches(3))
    for rank, r in enumerate(results):
        got = r[case["id"]]
        _close(got["returned"], ref["losses"], f"rank {rank} returned losses")
        _close(got["logged"], ref["losses"], f"rank {rank} logged losses")
    params = merged_params(results, case["id"])
    assert params.keys() == ref["params"].keys()
    for name, want in ref["params"].items():
        _close(params[name], want, name)
    assert max(ref["norms"]) > 0.3  # clipping really scaled the gradients
    val = _val_reference(ref["params"], make_batches(3))
    for rank, r in enumerate(results):
        _close(r[case["id"]]["val_loss"], val, f"rank {rank} validation loss")


def _val_reference(params: dict[str, torch.Tensor], batches: list[Any]) -> float:
    """The trained model's mean loss over the validation batches (unshuffled), one process."""
    model = make_model()
    model.load_state_dict(params)
    with torch.no_grad():
        losses = [float(lm_loss(model(x), y)) for x, y in batches]
    return sum(losses) / len(losses)
