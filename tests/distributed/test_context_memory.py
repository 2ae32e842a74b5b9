"""Context parallelism cuts the activations each rank holds: at a long sequence (the bundled GPT,
4 gloo ranks) the bytes saved for backward per rank are the planner's CP figure, and 1/cp of
cp 1's (issue 31: within 15%).

On the CPU the runtime's attention runs by blocks (`core.step.context_blocks`): it keeps no
gathered K/V and no (L/cp x L) mask, so nothing but the rank's own tokens is saved. (The masked
path, which other devices run, keeps both; `tests/unit/test_plan_context.py` prices it.)"""

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


@pytest.mark.parametrize("cp", CPS)
def test_each_ranks_activation_peak_is_the_planners_cp_figure(peaks, cp):
    for rank in peaks:
        got = rank[str(cp)]
        assert got["measured"] == pytest.approx(got["planner"], rel=0.02), rank


@pytest.mark.parametrize("cp", [2, 4])
def test_the_activation_peak_is_one_over_cp(peaks, cp):
    for rank in peaks:
        one, mine = rank["1"]["measured"], rank[str(cp)]["measured"]
        print(f"cp {cp}: peak {mine / one:.3f} of cp 1's (1/cp = {1 / cp:.3f})")
        assert mine == pytest.approx(one / cp, rel=0.15)
