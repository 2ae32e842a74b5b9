"""The layout search and its command line: only layouts that fit, fastest first, and a written
layout the recipes accept."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.models import GPT, GPTConfig
from lightning_zeropp.plan import Hardware
from lightning_zeropp.plan.peaks import rank_memory
from lightning_zeropp.plan.search import enumerate_layouts, search

WORLD, BATCH, SEQ = 8, 16, 32


def _model() -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=512, seq_len=SEQ, dim=64, num_heads=2, num_layers=8))


def _hardware(memory: int | None) -> Hardware:
    return Hardware(
        flops_per_s=1e11, intra_node_Bps=1e9, inter_node_Bps=1e8, node_size=4,
        latency_s=1e-5, memory_Bps=1e10, memory_bytes=memory,
    )  # fmt: skip


def test_layouts_cover_the_world_and_all_resolve() -> None:
    layouts = list(enumerate_layouts(WORLD, 8, BATCH, 4))
    shapes = {(s["pp_size"], s["dp_replicate_size"], s["dp_shard_size"]) for s in layouts}
    assert all(pp * rep * shard == WORLD for pp, rep, shard in shapes)
    assert {s["schedule"] for s in layouts} == {"1f1b", "interleaved_1f1b", "zbv", "zeropp"}
    assert (1, 1, 8) in shapes  # FSDP over the whole world: a shard group may span nodes
    assert (1, 1, 2) not in {(p, r, s) for p, r, s in shapes if r * s != WORLD // p}


def test_search_returns_only_layouts_that_fit_fastest_first() -> None:
    model = _model()
    layouts = list(enumerate_layouts(WORLD, 8, BATCH, 4))[::7]  # a spread, to keep it quick
    need = {
        i: max(r["total"] for r in rank_memory(model, ZeroPPConfig(**s), WORLD, BATCH, SEQ))
        for i, s in enumerate(layouts)
    }
    budget = sorted(need.values())[len(need) // 2]  # about half of them fit
    found = search(model, WORLD, BATCH, SEQ, _hardware(budget), layouts=layouts, top=100)
    fits = {i for i, n in need.items() if n <= budget}
    assert 0 < len(found) == len(fits) < len(layouts)
    assert all(c.memory_bytes <= budget for c in found)
    assert [c.step_s for c in found] == sorted(c.step_s for c in found)
    everything = search(model, WORLD, BATCH, SEQ, _hardware(None), layouts=layouts, top=100)
    assert len(everything) == len(layouts)
    assert found[0].step_s == min(c.step_s for c in everything if c.memory_bytes <= budget)


def test_no_layout_fits_a_budget_below_every_layout() -> None:
    layouts = list(enumerate_layouts(WORLD, 8, BATCH, 4))[:20]
    assert search(_model(), WORLD, BATCH, SEQ, _hardware(1000), layouts=layouts) == []


def test_the_command_line_writes_a_layout_the_recipes_accept(tmp_path: Path, capsys) -> None:
    from lightning_zeropp.plan.__main__ import main
    from recipes.recipe_config import check_config
    from tests.unit.test_conf import compose_config

    out = tmp_path / "chosen.yaml"
    assert main(["global_batch=32", "top=3", f"write={out}"]) == 0
    printed = capsys.readouterr().out
    assert "gpt_tiny on cpu4 (4 ranks)" in printed
    assert "even cut (s)" in printed  # each layout's step under the parameter cut, beside it
    table, _, per_cp = printed.partition("the fastest layout that fits, per cp_size:")
    ranked = [line.split()[0] for line in table.splitlines() if "pp " in line and " x rep " in line]
    assert ranked == ["1", "2", "3"]
    assert per_cp.split()[:2] == ["cp", "1:"]  # the searched cp sizes' best, each
    assert "#1's last stage (pp rank" in table  # its activation peak, the loss priced as run
    chosen = yaml.safe_load(out.read_text())
    ZeroPPConfig(**chosen).resolve(4)
    (Path("conf/parallel") / "zz_test_chosen.yaml").write_text(out.read_text())
    try:
        cfg = compose_config(["parallel=zz_test_chosen"])
        assert check_config(cfg).zeropp.pp_size == chosen["pp_size"]
    finally:
        (Path("conf/parallel") / "zz_test_chosen.yaml").unlink()


def test_the_command_line_prices_the_loss_in_the_chunks_asked_for(capsys) -> None:
    from lightning_zeropp.plan.__main__ import main

    assert main(["global_batch=32", "top=1", "write=none", "loss_chunk=4"]) == 0
    last = capsys.readouterr().out.split("#1's last stage")[1]
    # gpt_tiny's best layout at 4 ranks: the head and the loss in chunks, less than whole logits
    assert "in chunks of 4 tokens" in last, last
    chunked, whole = (
        float(x) * (1024 if unit == "GiB" else 1)
        for x, unit in re.findall(r"([0-9.]+) (GiB|MiB)", last)
    )
    assert chunked < whole
    for bad, message in (
        ("loss_chunk=-1", "loss_chunk=-1 must be a whole number"),
        ("split=cut", "split='cut' is not a split"),
        ("cp_size=2", "context parallelism \\(cp_size=2\\)"),
    ):
        with pytest.raises(SystemExit, match=message):
            main(["global_batch=32", "write=none", "loss_chunk=4", bad])


def test_the_command_line_names_a_budget_nothing_fits(capsys) -> None:
    from lightning_zeropp.plan.__main__ import main

    assert main(["global_batch=32", "write=none", "cluster.planner.memory_GiB=1e-6"]) == 1
    assert "No layout fits" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["cluster=cpu4", "cluster=h100_1x8"])
def test_cluster_files_give_the_planner_what_it_needs(bad: str) -> None:
    from tests.unit.test_conf import compose_config

    cluster = dict(compose_config([bad]).cluster)
    hw = Hardware.from_cluster(cluster, "fp32" if cluster["accelerator"] == "cpu" else "bf16")
    assert hw.flops_per_s > 0 and hw.memory_bytes and hw.node_size == cluster["devices"]
    cluster.pop("planner")
    with pytest.raises(ValueError, match="planner.peak_tflops"):
        Hardware.from_cluster(cluster)


def test_parallel_auto_takes_the_searchs_best_and_says_when_nothing_fits() -> None:
    from recipes.recipe_config import check_config
    from tests.unit.test_conf import compose_config

    plan = check_config(compose_config(["parallel=auto"]))
    assert plan.global_batch_size == 32 and plan.micro_batch_size == 4
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, seq_len=64, dim=128, num_heads=4, num_layers=8))
    cluster = dict(compose_config([]).cluster)
    layouts = [
        s
        for s in enumerate_layouts(4, 8, 32, 4)
        if 32 // (4 // s["pp_size"]) // s["num_microbatches"] == 4
    ]
    (best,) = search(
        model, 4, 32, 64, Hardware.from_cluster(cluster, "fp32"), layouts=layouts, top=1
    )
    chosen = ZeroPPConfig(**best.settings).resolve(4)
    for key in ("pp_size", "dp_shard_size", "schedule", "num_chunks", "num_microbatches"):
        assert getattr(plan.zeropp, key) == getattr(chosen, key), key
    with pytest.raises(ValueError, match="parallel=auto: no layout"):
        check_config(compose_config(["parallel=auto", "cluster.planner.memory_GiB=1e-6"]))


def test_the_planner_ignores_the_launchers_ranks_per_node(monkeypatch) -> None:
    # Under torchrun every process sees LOCAL_WORLD_SIZE; the planner's own stand-in configs
    # (stage cuts, torch's orders) must not take it for theirs, nor the planned layouts.
    from recipes.recipe_config import check_config
    from tests.unit.test_conf import compose_config

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    plan = check_config(compose_config(["parallel=auto"]))
    assert plan.zeropp.pp_size * plan.zeropp.dp_size == 4
    layouts = list(enumerate_layouts(WORLD, 8, BATCH, 4))[:12]
    assert search(_model(), WORLD, BATCH, SEQ, _hardware(None), layouts=layouts)


def test_a_batch_no_layout_splits_is_refused_not_replaced(capsys) -> None:
    # An empty filtered space is an answer (nothing fits), not a cue to search everything: a
    # batch of 6 rows in micro-batches of 4 must not train 24 rows instead.
    from lightning_zeropp.plan.__main__ import main
    from recipes.recipe_config import check_config
    from tests.unit.test_conf import compose_config

    assert search(_model(), WORLD, BATCH, SEQ, _hardware(None), layouts=[]) == []
    with pytest.raises(ValueError, match="do not split into micro-batches"):
        check_config(compose_config(["parallel=auto", "parallel.auto.global_batch_size=6"]))
    assert main(["global_batch=32", "micro_batch=3", "write=none"]) == 1
    assert "No layout splits global_batch=32" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="global_batch='abc' must be a positive integer"):
        main(["global_batch=abc"])


def test_predictions_refuse_what_would_not_run_or_is_priced_for_another_dtype() -> None:
    from lightning_zeropp.plan import activation_peaks, predict_step_time

    model = _model()
    with pytest.raises(ValueError, match="global_batch=15 does not split"):
        activation_peaks(model, ZeroPPConfig(dp_shard_size=2), 2, 15, SEQ)
    bf16 = Hardware(flops_per_s=1e12, intra_node_Bps=1e9, inter_node_Bps=1e9, node_size=2,
                    dtype="bf16")  # fmt: skip
    with pytest.raises(ValueError, match="rate is for bf16 but the layout computes in fp32"):
        predict_step_time(model, ZeroPPConfig(dp_shard_size=2), 2, 16, SEQ, bf16)
    assert (
        predict_step_time(
            model, ZeroPPConfig(dp_shard_size=2, param_dtype="bf16"), 2, 16, SEQ, bf16
        ).step_s
        > 0
    )


def test_the_search_skips_layouts_it_need_not_simulate_and_finds_the_same_best(
    monkeypatch,
) -> None:
    # Layouts are simulated in order of a bound no simulation beats and the search stops once
    # that bound is worse than the top-th step found: the top is what simulating all gives.
    from lightning_zeropp.plan import steptime

    model = _model()
    layouts = list(enumerate_layouts(WORLD, 8, BATCH, 4))[::5]
    # compute-bound (fast links): recomputing layouts cannot beat the best, nor be simulated
    hw = Hardware(flops_per_s=1e9, intra_node_Bps=1e15, inter_node_Bps=1e14, node_size=4,
                  latency_s=1e-9, memory_Bps=1e15)  # fmt: skip
    everything = search(model, WORLD, BATCH, SEQ, hw, layouts=layouts, top=1000)
    simulated = []
    plan = steptime.Priced.plan
    monkeypatch.setattr(steptime.Priced, "plan", lambda self: simulated.append(1) or plan(self))
    best = search(model, WORLD, BATCH, SEQ, hw, layouts=layouts, top=3)
    assert [c.settings for c in best] == [c.settings for c in everything[:3]]
    assert [c.step_s for c in best] == [c.step_s for c in everything[:3]]
    assert 3 <= len(simulated) < len(layouts)
