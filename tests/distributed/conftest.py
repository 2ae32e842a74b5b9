"""Shared fixtures: launch a batch of cases once per world size, compare each case separately.

A launch runs the cases its module's selected tests check: a case wrapped in `slow_case` (a sweep
row, left to bench/slow_tests.py for time) is launched only when a test parametrized with it runs,
so marking a case slow takes its cost out of CI, not only its assertions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.common import GLOBAL_BATCH, reference
from tests.distributed.launch import launch


def slow_case(*values: Any) -> Any:
    """A parametrization entry marked slow: `slow_case(case)` or `slow_case(world, case)`, with the
    case dict's "id" as the test id."""
    case = next(v for v in values if isinstance(v, dict) and "id" in v)
    return pytest.param(
        *values, marks=pytest.mark.slow, id=case["id"] if len(values) == 1 else None
    )


def case_of(entry: Any) -> dict[str, Any]:
    """The case dict of a parametrization entry (a dict, a (world, case) tuple, or a
    `pytest.param` of either)."""
    values = entry.values if hasattr(entry, "values") and hasattr(entry, "marks") else entry
    values = values if isinstance(values, tuple) else (values,)
    return next(v for v in values if isinstance(v, dict) and "id" in v)


def _is_slow(entry: Any) -> bool:
    return any(m.name == "slow" for m in getattr(entry, "marks", ()))


def selected_values(request: Any, name: str | None = None) -> set[Any]:
    """What this session's selected tests of the requesting module are parametrized with: the
    values of parameter `name` (by default the id of every case dict, whatever its parameter's
    name), plus the case ids they name with `@pytest.mark.cases("id", ...)`."""
    chosen: set[Any] = set()
    for item in request.session.items:
        if item.module is not request.module:
            continue
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if name is not None:
            chosen |= {params[name]} if name in params else set()
        else:
            chosen |= {v["id"] for v in params.values() if isinstance(v, dict) and "id" in v}
        for mark in item.iter_markers("cases"):
            chosen |= set(mark.args)
    return chosen


def selected_cases(request: Any, entries: Iterable[Any]) -> list[dict[str, Any]]:
    """The cases of `entries` a launch must run in this session: every plain one (other tests of
    the module may read it), and a slow one only if a selected test is parametrized with it or
    names it (`@pytest.mark.cases("id", ...)`)."""
    chosen = selected_values(request)
    return [case_of(e) for e in entries if not _is_slow(e) or case_of(e)["id"] in chosen]


def as_params(entries: Iterable[Any]) -> list[Any]:
    """Parametrization entries (cases or `slow_case`s) as `pytest.param`s with their case's id
    and marks."""
    return [pytest.param(case_of(e), id=case_of(e)["id"], marks=_marks(e)) for e in entries]


def by_world(cases_by_world: dict[int, list[Any]]) -> list[Any]:
    """The `("world", "case")` parametrization of a `{world: [case or slow_case(case)]}` table,
    each with the id `w{world}-{case id}` and its case's marks."""
    return [
        pytest.param(world, case_of(e), id=f"w{world}-{case_of(e)['id']}", marks=_marks(e))
        for world, entries in cases_by_world.items()
        for e in entries
    ]


def _marks(entry: Any) -> tuple[Any, ...]:
    return tuple(getattr(entry, "marks", ()))


def core_results_by_world(
    tmp_path_factory: Any,
    cases_by_world: dict[int, list[Any]],
    name: str,
    request: Any = None,
) -> Callable[[int], list[Any]]:
    """Run each world size's core cases in one launch, on first use, and remember the results.

    With `request` (the module fixture's), a world's launch runs only its `selected_cases`."""
    cache: dict[int, list[Any]] = {}

    def get(world: int) -> list[Any]:
        if world not in cache:
            out = tmp_path_factory.mktemp(f"{name}{world}")
            entries = cases_by_world[world]
            cases = (
                [case_of(e) for e in entries]
                if request is None
                else selected_cases(request, entries)
            )
            cache[world] = launch(
                world, "core_scenarios.parity", {"cases": cases}, out, timeout=600
            )
        return cache[world]

    return get


def against_one_process(
    out: Path, world: int, scenario: str, cases: list[Any], references: list[Any]
) -> tuple[list[Any], Any]:
    """`scenario` run with `cases` on `world` ranks (under `out/many`) and with `references`,
    each case's one-process run, on one (under `out/one`): every rank's results, and the one
    process's."""
    ranks = launch(
        world, scenario, {"cases": cases, "out_dir": str(out / "many")}, out / "many", timeout=600
    )
    one = launch(
        1, scenario, {"cases": references, "out_dir": str(out / "one")}, out / "one", timeout=600
    )
    return ranks, one[0]


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
