"""Context parallelism cuts the activations each rank holds: at a long sequence (the bundled GPT,
4 gloo ranks) the bytes saved for backward per rank are the planner's CP figure, and their part
that grows with the rank's tokens is 1/cp of cp 1's.

What the runtime's attention keeps on top (`core.step.context_attention`: K and V gathered over
the whole sequence per call, and one (L/cp x L) mask per micro-batch, which every layer's call
shares) is counted by the planner and taken out before comparing with 1/cp; the whole peaks'
ratios are printed (the bench reports them)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LENGTH, CPS = 1024, [1, 2, 4]


@pytest.fixture(scope="module")
def peaks(tmp_path_factory: Any) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("context_memory")
    params = {"length": LENGTH, "cps": CPS}
    return launch(4, "context_memory_scenarios.run", params, out, timeout=900)


def _attention_terms(cp: int) -> int:
    """What one rank's attention calls keep beyond its tokens' share: per layer, K and V of the
    whole sequence; and one (LENGTH/cp x LENGTH) mask that every layer's call shares, fp32 (a
    model of dim 256, 2 layers)."""
    if cp == 1:
        return 0
    from tests.distributed.context_memory_scenarios import model_config

    cfg = model_config(LENGTH)
    return cfg.num_layers * 2 * LENGTH * cfg.dim * 4 + (LENGTH // cp) * LENGTH * 4


@pytest.mark.parametrize("cp", CPS)
def test_each_ranks_activation_peak_is_the_planners_cp_figure(peaks, cp):
    for rank in peaks:
        got = rank[str(cp)]
        assert got["measured"] == pytest.approx(got["planner"], rel=0.02), rank


@pytest.mark.parametrize("cp", [2, 4])
def test_the_tokens_share_of_the_activation_peak_is_one_over_cp(peaks, cp):
    for rank in peaks:
        one, mine = rank["1"]["measured"], rank[str(cp)]["measured"]
        print(f"cp {cp}: peak {mine / one:.2f} of cp 1's (1/cp = {1 / cp:.2f})")
        assert (mine - _attention_terms(cp)) == pytest.approx(one / cp, rel=0.15)
        assert mine < one  # and the whole peak falls
