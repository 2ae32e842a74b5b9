"""Stages cut by cost (`core.split.cost`): a model whose head and loss cost about three blocks gets
blocks moved off the pipeline rank that holds the head, under one stage per rank, a loop and a V
(where rank 0 holds both the first and the last stage); given split points still win; a model
the profile cannot run keeps the parameter cut and says so."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zeropp.core import ZeroPPConfig
from lightning_zeropp.core.engine_build import block_plan
from lightning_zeropp.core.split import cost
from lightning_zeropp.core.split.cost import PieceCosts, cost_cut, measure_costs, rank_loads
from lightning_zeropp.models import GPT, GPTConfig

SEQ = 16


def _big_head() -> GPT:
    # dim 32, 8 blocks: a vocabulary of 1280 makes the head + loss about 3 blocks' FLOPs
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=1280, seq_len=SEQ, dim=32, num_heads=2, num_layers=8))


def _layout(world: int, **kw) -> object:
    return ZeroPPConfig(**kw).resolve(world)


def test_the_head_costs_about_three_blocks() -> None:
    costs = measure_costs(_big_head(), SEQ, recompute=False)
    assert isinstance(costs, PieceCosts)
    assert 2.5 < costs.head_in_blocks() < 3.5, costs
    assert len(set(costs.blocks)) == 1  # identical blocks cost alike


@pytest.mark.parametrize(
    ("schedule", "pp", "chunks", "head_rank"),
    [("1f1b", 4, 1, 3), ("interleaved_1f1b", 2, 2, 1), ("zbv", 2, 2, 0)],
    ids=["one-stage-per-rank", "loop", "v"],
)
def test_blocks_move_off_the_rank_holding_the_head(schedule, pp, chunks, head_rank) -> None:
    layout = _layout(pp, **_kw(schedule, pp, chunks))
    even = block_plan(
        _big_head(), _layout(pp, **_kw(schedule, pp, chunks), split_points=_even(pp * chunks))
    )
    plan = block_plan(_big_head(), layout, (torch.zeros(1, SEQ, dtype=torch.long),))
    assert plan is not None and even is not None and plan.costs is not None
    assert "cost" in plan.basis and f"at {SEQ} tokens" in plan.basis, plan.basis
    style = {"1f1b": "single", "interleaved_1f1b": "looped", "zbv": "v"}[schedule]

    def blocks_on(p, rank: int) -> int:
        return sum(len(r) for s, r in enumerate(p.ranges) if _rank(style, s, pp) == rank)

    assert blocks_on(plan, head_rank) < blocks_on(even, head_rank), plan.ranges
    starts = [r.start for r in plan.ranges]
    loads = rank_loads(plan.costs, starts, style, pp)
    even_loads = rank_loads(plan.costs, [r.start for r in even.ranges], style, pp)
    assert max(loads) < max(even_loads), (loads, even_loads)
    assert max(range(pp), key=lambda r: even_loads[r]) == head_rank  # the head made it busiest


def _kw(schedule: str, pp: int, chunks: int) -> dict:
    return {"pp_size": pp, "schedule": schedule, "num_microbatches": 4, "num_chunks": chunks}


def _even(num_stages: int) -> list[int]:
    return [i * 8 // num_stages for i in range(1, num_stages)]


def _rank(style: str, stage: int, pp: int) -> int:
    from lightning_zeropp.core.settings.placement import rank_of_stage

    return rank_of_stage(style, stage, pp)  # type: ignore[arg-type]


def test_given_split_points_win() -> None:
    layout = _layout(4, pp_size=4, num_microbatches=4, split_points=[2, 4, 6])
    plan = block_plan(_big_head(), layout, (torch.zeros(1, SEQ, dtype=torch.long),))
    assert plan is not None and [r.start for r in plan.ranges] == [0, 2, 4, 6]
    assert plan.basis == "the given split_points" and plan.costs is None


def test_a_model_the_profile_cannot_run_keeps_the_parameter_cut() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])  # takes floats, not token ids
    plan = block_plan(model, _layout(2, pp_size=2, num_microbatches=2))
    assert plan is not None and [r.start for r in plan.ranges] == [0, 2]
    assert plan.basis.startswith("parameters (cost not measured: RuntimeError"), plan.basis


def test_the_local_search_finds_what_pricing_every_cut_finds(monkeypatch) -> None:
    """Above `_EXHAUSTIVE` cuts the search moves blocks; on cases small enough to price every
    cut, it ends where pricing them all does (uneven blocks, a costly head, loops and Vs)."""
    blocks = (3.0, 1.0, 2.0, 2.0, 5.0, 1.0, 1.0, 2.0, 3.0, 1.0, 2.0, 2.0, 1.0, 4.0)
    costs = PieceCosts(before=0.5, blocks=blocks, after=6.0, seq_len=1)
    for style, pp, stages in [("single", 4, 4), ("looped", 2, 4), ("v", 2, 4), ("v", 3, 6)]:
        start = [i * len(blocks) // stages for i in range(stages)]
        every = cost_cut(costs, stages, style, pp, start)
        with monkeypatch.context() as m:
            m.setattr(cost, "_EXHAUSTIVE", 0)
            local = cost_cut(costs, stages, style, pp, start)
        assert max(rank_loads(costs, local, style, pp)) == max(
            rank_loads(costs, every, style, pp)
        ), (style, pp, local, every)


def test_a_cut_that_does_not_fit_is_not_taken() -> None:
    costs = PieceCosts(before=0.0, blocks=(1.0,) * 8, after=3.0, seq_len=1)
    start = [0, 2, 4, 6]
    free = cost_cut(costs, 4, "single", 4, start)
    assert free != start
    # memory: no stage may hold more than 2 blocks
    capped = cost_cut(costs, 4, "single", 4, start, fits=lambda s: max(_sizes(s, 8)) <= 2)
    assert capped == start


def _sizes(starts: list[int], n: int) -> list[int]:
    bounds = [*starts, n]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("schedule", ["1f1b", "zbv", "zeropp"])
def test_the_planner_prices_the_cut_the_engine_takes(schedule) -> None:
    """One cost count for both: the planner's balanced `split_points` are the engine's default."""
    from lightning_zeropp.plan.cut import with_cut

    kw = {"pp_size": 2, "schedule": schedule, "num_microbatches": 4}
    if schedule == "zeropp":
        kw.update(num_chunks=2, unit_size=2)
    settings = with_cut(_big_head(), kw, SEQ, "balanced", 2)
    plan = block_plan(_big_head(), _layout(2, **kw), (torch.zeros(1, SEQ, dtype=torch.long),))
    assert plan is not None
    assert settings["split_points"] == [r.start for r in plan.ranges][1:]
    even = with_cut(_big_head(), kw, SEQ, "even", 2)["split_points"]
    assert even == _even(len(plan.ranges)) != settings["split_points"]


def test_the_layout_prints_the_cut_and_each_ranks_share(monkeypatch) -> None:
    from types import SimpleNamespace

    from lightning_zeropp.core.measure import layout as printed

    config = _layout(4, **_kw("1f1b", 4, 1))
    plan = block_plan(_big_head(), config, (torch.zeros(1, SEQ, dtype=torch.long),))
    assert plan is not None

    def gather(parts: list, mine: dict, group: object = None) -> None:  # every rank's counts
        parts[:] = [{s: 1} for s in range(4)]

    monkeypatch.setattr(printed.dist, "all_gather_object", gather)
    monkeypatch.setattr(printed.dist, "get_world_size", lambda: 4)
    engine = SimpleNamespace(
        config=config, dims=SimpleNamespace(pp_group=None), stage_ids=[0],
        _stage_modules=[nn.Linear(1, 1)], plan=plan, num_stages=4, style="single", split="call",
    )  # fmt: skip
    text = printed.describe_layout(engine)
    assert f"stages cut by cost (forward + backward FLOPs at {SEQ} tokens" in text, text
    loads = rank_loads(plan.costs, [r.start for r in plan.ranges], "single", 4)
    shares = ", ".join(f"{r} {x / sum(loads):.1%}" for r, x in enumerate(loads))
    assert f"each pp rank's share of the work (forward + backward FLOPs): {shares}" in text
    print(text)
