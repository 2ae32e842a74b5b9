"""The ZeroPP unit order: the design's formulas, gather blocks, and no deadlock over a sweep."""

import itertools

import pytest

from lightning_zeropp.core.zeropp_schedule import (
    Task,
    check_orders,
    gather_blocks,
    rank_order,
    units,
)


def test_units_leave_a_smaller_last_unit():
    assert units(7, 3) == [range(0, 3), range(3, 6), range(6, 7)]


def test_unit_order_matches_the_design():
    # pp 2, v 2, one unit of 2 on rank 0: warm-up min(2*1 + 1*2, 4) = 4 forwards, chunk by chunk
    order = [str(t) for t in rank_order(0, 2, 2, 2, 2)]
    assert order == ["0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"]
    # rank 1: warm-up min(0 + 2, 4) = 2, then F/B pairs on the last chunk, then cool-down
    order = [str(t) for t in rank_order(1, 2, 2, 2, 2)]
    assert order == ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1B0", "1B1"]


@pytest.mark.parametrize(
    ("pp", "v", "m", "u"), [(2, 2, 4, 2), (2, 2, 8, 4), (4, 2, 8, 4), (2, 3, 6, 2)]
)
def test_each_unit_gathers_each_chunk_2v_minus_1_times(pp, v, m, u):
    n_units = len(units(m, u))
    for rank in range(pp):
        blocks = gather_blocks(rank_order(rank, pp, v, m, u))
        # blocks of chunk 0 meet across unit boundaries and share a gather
        assert len(blocks) == n_units * (2 * v - 1) - (n_units - 1)


SWEEP = [
    (pp, v, m, u)
    for pp, v, m, u in itertools.product([1, 2, 3, 4], [1, 2, 3], range(1, 10), range(1, 6))
    if u <= m
]


@pytest.mark.parametrize(("pp", "v", "m", "u"), SWEEP)
def test_orders_obey_dependencies(pp, v, m, u):
    """Includes units smaller than pp (a larger bubble, but no deadlock)."""
    orders = {r: rank_order(r, pp, v, m, u) for r in range(pp)}
    check_orders(orders, pp * v, m)


def test_checker_finds_a_deadlock():
    orders = {0: [Task(0, "B", 0), Task(0, "F", 0)]}
    with pytest.raises(ValueError, match="deadlocks"):
        check_orders(orders, 1, 1)
