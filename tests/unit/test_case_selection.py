"""A distributed test module's launch runs the cases its selected tests check: a case marked slow
(`slow_case`) is launched only when a selected test is parametrized with it or names it
(`@pytest.mark.cases`), so a sweep row marked slow leaves CI's time, not only its assertions."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.distributed.conftest import (
    as_params,
    by_world,
    case_of,
    selected_cases,
    selected_values,
    slow_case,
)

MODULE = object()
PLAIN, SLOW, NAMED = {"id": "plain"}, {"id": "slow"}, {"id": "named"}
ENTRIES = [PLAIN, slow_case(SLOW), slow_case(NAMED)]


def _item(module: Any = MODULE, case: dict | None = None, names: tuple[str, ...] = ()) -> Any:
    marks = [SimpleNamespace(args=names)] if names else []
    item = SimpleNamespace(
        module=module, iter_markers=lambda name: marks if name == "cases" else []
    )
    if case is not None:
        item.callspec = SimpleNamespace(params={"world": 2, "case": case})
    return item


def _request(*items: Any) -> Any:
    return SimpleNamespace(module=MODULE, session=SimpleNamespace(items=list(items)))


def _ids(request: Any) -> list[str]:
    return [c["id"] for c in selected_cases(request, ENTRIES)]


def test_a_slow_case_no_selected_test_reads_is_not_launched() -> None:
    assert _ids(_request(_item(case=PLAIN))) == ["plain"]
    assert _ids(_request()) == ["plain"]  # plain cases run even when no test names them


def test_a_slow_case_runs_when_its_test_or_a_test_naming_it_is_selected() -> None:
    assert _ids(_request(_item(case=SLOW))) == ["plain", "slow"]
    assert _ids(_request(_item(names=("named",)))) == ["plain", "named"]


def test_another_modules_tests_select_nothing_here() -> None:
    other = object()
    assert _ids(_request(_item(module=other, case=SLOW), _item(other, names=("named",)))) == [
        "plain"
    ]


def test_parametrization_entries_keep_their_marks_and_ids() -> None:
    (world_plain, world_slow) = by_world({4: [PLAIN, slow_case(SLOW)]})
    assert world_plain.id == "w4-plain" and not world_plain.marks
    assert world_slow.id == "w4-slow" and [m.name for m in world_slow.marks] == ["slow"]
    assert case_of(world_slow) is SLOW and case_of(ENTRIES[1]) is SLOW
    assert case_of((4, PLAIN)) is PLAIN
    with pytest.raises(StopIteration):
        case_of({"no": "id"})


def test_a_named_parameter_selects_by_its_values() -> None:
    """The planner's launch keys its layouts by an `index` parameter, not a case dict."""
    indexed = SimpleNamespace(
        module=MODULE, iter_markers=lambda name: [], callspec=SimpleNamespace(params={"index": 5})
    )
    assert selected_values(_request(indexed, _item(case=SLOW)), "index") == {5}
    assert selected_values(_request(_item(case=SLOW))) == {"slow"}


def test_cases_as_params_keep_their_ids_and_marks() -> None:
    plain, slow = as_params([PLAIN, slow_case(SLOW)])
    assert (plain.id, plain.marks, plain.values) == ("plain", (), (PLAIN,))
    assert slow.id == "slow" and [m.name for m in slow.marks] == ["slow"]
