"""The ZeroPP unit order: the design's formulas, gather blocks, and no deadlock over a sweep."""

import itertools

import pytest

from lightning_zeropp.core.schedule.zeropp import (
    Task,
    bubble_formula,
    check_orders,
    gather_blocks,
    rank_order,
    reduce_points,
    simulate,
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


def test_split_backward_holds_back_2r_plus_1_weight_tasks_to_the_end_of_the_unit():
    # pp 2, v 2, one unit of 4. Rank 0: warm-up min(2 + 4, 8) = 6, steady 2, holds min(1, 2) = 1.
    order = [str(t) for t in rank_order(0, 2, 2, 4, 4, split_backward=True)]
    assert order == (
        ["0F0", "0F1", "0F2", "0F3", "2F0", "2F1", "2F2", "2I0", "2F3", "2I1", "2W1"]
        + ["2I2", "2W2", "2I3", "2W3", "0I0", "0W0", "0I1", "0W1", "0I2", "0W2", "0I3", "0W3"]
        + ["2W0"]
    )
    # Rank 1: warm-up min(0 + 4, 8) = 4, steady 4, holds min(3, 4) = 3, run last held first.
    order = [str(t) for t in rank_order(1, 2, 2, 4, 4, split_backward=True)]
    assert order[-3:] == ["3W2", "3W1", "3W0"]
    assert "3W3" in order[: order.index("1I0")]


def test_held_back_weight_tasks_cost_no_gather():
    for rank in range(2):
        split = gather_blocks(rank_order(rank, 2, 2, 8, 4, split_backward=True))
        full = gather_blocks(rank_order(rank, 2, 2, 8, 4))
        assert [b[0] for b in split] == [b[0] for b in full]


def test_recomputed_stages_keep_a_full_backward():
    order = rank_order(1, 2, 2, 4, 4, split_backward=True, full_backward={1})
    assert {t.kind for t in order if t.stage == 1} == {"F", "B"}
    assert {t.kind for t in order if t.stage == 3} == {"F", "I", "W"}


@pytest.mark.parametrize(("pp", "v", "m", "u"), SWEEP)
def test_split_orders_obey_dependencies(pp, v, m, u):
    orders = {r: rank_order(r, pp, v, m, u, split_backward=True) for r in range(pp)}
    check_orders(orders, pp * v, m)


def test_checker_finds_a_weight_task_before_its_input_task():
    orders = {0: [Task(0, "F", 0), Task(0, "W", 0), Task(0, "I", 0)]}
    with pytest.raises(ValueError, match="deadlocks"):
        check_orders(orders, 1, 1)


def test_reduce_points_per_step_unit_and_microbatch():
    order = rank_order(0, 2, 2, 8, 4, split_backward=True)  # two units of 4
    assert reduce_points(order, 4, "step") == []
    # unit 0 ends with chunk 0's last W and then the held-back W of chunk 1 (stage 2)
    assert [str(order[i]) for i in reduce_points(order, 4, "unit")] == ["0W3", "2W0"]
    grads = [i for i, t in enumerate(order) if t.kind == "W"]
    last = {order[i].stage: i for i in grads}
    assert reduce_points(order, 4, "microbatch") == [i for i in grads if i not in last.values()]


@pytest.mark.parametrize(("pp", "v", "u"), [(2, 2, 2), (4, 2, 4), (4, 2, 8), (4, 3, 4)])
def test_simulated_bubble_matches_the_formula_without_the_split(pp, v, u):
    orders = {r: rank_order(r, pp, v, u, u) for r in range(pp)}  # one unit
    timeline = simulate(orders, pp * v, u)
    span = max(t[-1][2] for t in timeline.values())
    busy = sum(end - start for t in timeline.values() for _, start, end in t)
    assert 1 - busy / (pp * span) == pytest.approx(bubble_formula(pp, v, u))
    split = {r: rank_order(r, pp, v, u, u, split_backward=True) for r in range(pp)}
    split_span = max(t[-1][2] for t in simulate(split, pp * v, u).values())
    assert split_span < span  # held-back W's fill the tail bubble
