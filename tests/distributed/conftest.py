"""Shared fixtures: launch a batch of cases once per world size, compare each case separately."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.common import GLOBAL_BATCH, reference
from tests.distributed.launch import launch


def core_results_by_world(
    tmp_path_factory: Any, cases_by_world: dict[int, list[dict[str, Any]]], name: str
) -> Callable[[int], list[Any]]:
    """Run each world size's core cases in one launch, on first use, and remember the results."""
    cache: dict[int, list[Any]] = {}

    def get(world: int) -> list[Any]:
        if world not in cache:
            out = tmp_path_factory.mktemp(f"{name}{world}")
            params = {"cases": cases_by_world[world]}
            cache[world] = launch(world, "core_scenarios.parity", params, out, timeout=600)
        return cache[world]

    return get


def merged_params(results: list[dict[str, Any]], case_id: str, prefix: str = "") -> dict[str, Any]:
    """Each rank reports the parameters of its stages: the union is the whole model."""
    params: dict[str, Any] = {}
    for rank_result in results:
        for name, value in rank_result[case_id]["params"].items():
            params[name.removeprefix(prefix)] = value
    return params


def assert_matches_reference(
    results: list[dict[str, Any]],
    case: dict[str, Any],
    losses_key: str = "losses",
    prefix: str = "",
    batches: Any = None,
    accumulate: int = 1,
    ref: dict[str, Any] | None = None,
) -> None:
    """Loss at every step and every parameter after training within 1e-5 of one process.

    `ref`: a reference run already computed (e.g. `reference(..., model_fn=..., loss_fn=...)` for
    another model); by default the bundled GPT's is computed from `case`.
    """
    ref = ref or reference(
        case.get("optimizer", "sgd"),
        case.get("clip", False),
        case.get("steps", 3),
        batches=batches,
        accumulate=accumulate,
        lr_schedule=case.get("lr_schedule"),
        global_batch=case.get("global_batch", GLOBAL_BATCH),
    )
    for rank, rank_result in enumerate(results):  # every rank reports the same global loss
        got = rank_result[case["id"]][losses_key]
        torch.testing.assert_close(
            torch.tensor(got),
            torch.tensor(ref["losses"]),
            rtol=0,
            atol=1e-5,
            msg=lambda m, r=rank, g=got: f"rank {r} losses {g} vs reference {ref['losses']}: {m}",
        )
    params = merged_params(results, case["id"], prefix)
    assert params.keys() == ref["params"].keys()
    for name, want in ref["params"].items():
        torch.testing.assert_close(
            params[name], want, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    if case.get("clip"):
        # The test only proves clipping if the norm really exceeded the limit.
        norms = results[0][case["id"]].get("norms")
        if norms:
            torch.testing.assert_close(
                torch.tensor(norms), torch.tensor(ref["norms"]), rtol=1e-5, atol=1e-6
            )
        assert max(ref["norms"]) > 0.3


@pytest.fixture(scope="session")
def sources(tmp_path_factory: Any) -> Path:
    """Weights on disk for the meta-build cases (`meta_scenarios.write_sources`)."""
    from tests.distributed.meta_scenarios import write_sources

    return write_sources(tmp_path_factory.mktemp("meta_sources"))
