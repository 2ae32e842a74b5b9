"""A NaN loss stops every rank with the step and the stage named, or skips exactly that step."""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.common import make_batches, reference
from tests.distributed.launch import launch
from tests.distributed.nonfinite_scenarios import BAD_STEP

pytestmark = pytest.mark.distributed

CASES = [
    {"id": "weights", "cause": "weights"},
    {"id": "loss", "cause": "loss"},
    {"id": "skip", "cause": "loss", "nonfinite": "skip"},
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("nonfinite")
    return launch(4, "nonfinite_scenarios.cases", {"cases": CASES}, out)


@pytest.mark.parametrize(
    ("cause", "where"),
    [
        ("weights", "the first non-finite output came from pipeline stage 1 (its weights hold"),
        ("loss", "every stage's output was finite, so the loss function (on the last stage, 1)"),
    ],
)
def test_nan_names_the_step_and_the_stage_on_every_rank(results, cause, where):
    for rank, r in enumerate(r[cause] for r in results):
        assert r["error"] is not None, f"rank {rank} trained on: {r['losses']}"
        assert f"non-finite loss (nan) at training step {BAD_STEP} (counting from 0)" in r["error"]
        assert where in r["error"], r["error"]
        assert len(r["losses"]) == BAD_STEP and all(math.isfinite(x) for x in r["losses"])


def test_skip_drops_exactly_the_bad_step(results):
    out = [r["skip"] for r in results]
    batches = make_batches(3)
    ref = reference("sgd", clip=False, steps=2, batches=[batches[0], batches[2]])
    params = {}
    for r in out:
        assert r["error"] is None and r["skipped"] == [BAD_STEP]
        assert math.isnan(r["losses"][BAD_STEP])
        torch.testing.assert_close(
            torch.tensor([r["losses"][0], r["losses"][2]]),
            torch.tensor(ref["losses"]),
            rtol=0,
            atol=1e-5,
        )
        params.update(r["params"])
    assert params.keys() == ref["params"].keys()
    for name, want in ref["params"].items():
        torch.testing.assert_close(params[name], want, rtol=0, atol=1e-5, msg=name)
