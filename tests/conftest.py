"""Marks the parity subset (`pytest -m parity`): the tests listed in tests/parity_subset.txt, which
CI runs on each end of the supported torch range (.ci/run) besides the whole suite on the default
torch. The list lives in one file, not in markers spread over the test modules."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SUBSET = Path(__file__).with_name("parity_subset.txt")


def parity_prefixes() -> list[str]:
    """The node-id prefixes the subset file lists (comments and blank lines dropped)."""
    lines = (line.split("#", 1)[0].strip() for line in SUBSET.read_text().splitlines())
    return [line for line in lines if line]


def pytest_collection_modifyitems(config: Any, items: list[pytest.Item]) -> None:
    prefixes = parity_prefixes()
    for item in items:
        # slow cases stay out (a prefix may cover one); bench/slow_tests.py runs them
        if item.nodeid.startswith(tuple(prefixes)) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.parity)
    # `pytest -m parity` over the whole suite: a listed prefix that names no test (a renamed test
    # or case) would silently shrink the subset; refuse it instead.
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    if whole_suite and "parity" in (config.getoption("markexpr") or ""):
        unmatched = [p for p in prefixes if not any(i.nodeid.startswith(p) for i in items)]
        if unmatched:
            raise pytest.UsageError(f"{SUBSET} names no test: {unmatched}")


@pytest.fixture(autouse=True)
def _environment_as_it_was() -> Iterator[None]:
    """Each test leaves the process environment as it found it. Ranks a test launches inherit
    the environment (`tests.distributed.launch`), so a variable another test left behind (for
    instance Lightning's `PL_GLOBAL_SEED`, which `seed_everything` and `LightningCLI` set and
    Lightning's distributed setup re-seeds every rank from) would otherwise change a later
    launch's numbers, depending on which tests ran before it in the same process."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)
