"""The ZeroPP paper's setting on paper: a LLaMA-2-7B-shaped model, sequence 2048, micro-batch 1,
on 32 GPUs (4 nodes x 8) and 64 GPUs (8 x 8), priced by the planner. No process runs: these are
predictions under stated assumptions (docs/planner.md), not measurements.

    python bench/bench_paper_claims.py [--quick]

Rows per world size (global batch 4 rows a GPU, 128 and 256 sequences):
- ZeroPP as its authors configured it (pp 4, v 4, U 4, weights sharded over a node, recompute all
  but the last chunk), and the same without recomputation;
- 1F1B over FSDP (pp 4, shard 8), and "memory-efficient" 1F1B (the same with full recomputation);
- FSDP alone (shard 8 inside a node, replicated across nodes);
- Megatron-style 3D with TP 8 (`plan.megatron`): the fastest of pp 1/2/4, interleaving 1/2 and
  recomputation on/off that fits;
- the search's best layout (`plan.search`) for the same memory.
Then two plots: step time and memory against U and v (32 GPUs), and predicted MFU from 8 to 1,024
GPUs for ZeroPP, 1F1B over FSDP, FSDP alone and 3D. And the comparison at equal memory: on 32
GPUs, the fastest layout of each family (ZeroPP, 1F1B / interleaved 1F1B / ZB-V over FSDP, FSDP
alone, Megatron-style 3D) whose busiest rank fits 16, 24, 32, 48 and 72 GiB, as a table and a
plot. Writes bench/results/paper_claims.{md,json,png}, paper_scaling.png and paper_memory.png.

Rates are the cluster file's, calibrated to published runs: each step time is the middle of the
eager efficiency range (the compiled range in the equal-memory sweep's compiled table), with
the range's ends where a table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402
from paper_claims_report import (  # noqa: E402
    BUDGETS_GIB,
    FAMILIES,
    ROWS_PER_GPU,
    SEQ,
    plot,
    plot_memory,
    write_markdown,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
GiB = 2**30
LLAMA_7B = {
    "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096,
}  # fmt: skip


def hardware(nodes: int) -> Any:
    import yaml

    from lightning_zeropp.plan import Hardware

    cluster = yaml.safe_load((ROOT / "conf" / "cluster" / "h100_4x8.yaml").read_text())
    cluster["num_nodes"] = nodes
    return Hardware.from_cluster(cluster, "bf16")


def zeropp_row(model: Any, world: int, hw: Any, settings: dict[str, Any], title: str) -> dict:
    from lightning_zeropp.core import ZeroPPConfig
    from lightning_zeropp.plan import predict_step_time
    from lightning_zeropp.plan.peaks import rank_memory

    batch = ROWS_PER_GPU * world
    config = ZeroPPConfig(param_dtype="bf16", **settings)
    step = predict_step_time(model, config, world, batch, SEQ, hw)
    memory = max(r["total"] for r in rank_memory(model, config, world, batch, SEQ))
    return {"title": title, "settings": settings, "step_s": step.step_s, "mfu": step.mfu,
            "memory_GiB": memory / GiB, "bubble": step.bubble}  # fmt: skip


def best_3d(model: Any, world: int, hw: Any) -> dict:
    from lightning_zeropp.plan.megatron import predict_3d

    batch = ROWS_PER_GPU * world
    found = []
    for pp in (1, 2, 4):
        for v in (1, 2):
            if v > 1 and pp == 1:
                continue
            dp = world // (8 * pp)
            m = batch // dp  # micro-batch 1, as the paper ran
            for recompute in (False, True):
                r = predict_3d(model, world, batch, SEQ, hw, tp=8, pp=pp, num_chunks=v,
                               num_microbatches=m, recompute=recompute)  # fmt: skip
                if r.memory_bytes <= (hw.memory_bytes or 0):
                    found.append(r)
    r = min(found, key=lambda x: x.step_s)
    return {"title": f"3D: TP 8 x PP {r.pp} (v {r.num_chunks}) x DP {r.dp}, {r.num_microbatches} "
            f"micro-batches{', full recompute' if r.recompute else ''}", "step_s": r.step_s,
            "mfu": r.mfu, "memory_GiB": r.memory_bytes / GiB, "settings": r.__dict__}  # fmt: skip


def rows_for(model: Any, world: int, quick: bool) -> list[dict]:
    from lightning_zeropp.plan.search import search

    hw = hardware(world // 8)
    rep = world // 32
    m = ROWS_PER_GPU * world // (8 * rep)  # rows per data-parallel rank: micro-batch 1
    zp = {"pp_size": 4, "dp_shard_size": 8, "dp_replicate_size": rep, "schedule": "zeropp",
          "num_chunks": 4, "unit_size": 4, "num_microbatches": m}  # fmt: skip
    f1 = {"pp_size": 4, "dp_shard_size": 8, "dp_replicate_size": rep, "schedule": "1f1b",
          "num_microbatches": m}  # fmt: skip
    rows = [
        zeropp_row(model, world, hw, {**zp, "activation_checkpointing": "except_last"},
                   "ZeroPP, the authors' layout (pp 4, v 4, U 4, shard 8, recompute all but the last chunk)"),
        zeropp_row(model, world, hw, zp, "ZeroPP, the same without recomputation"),
        zeropp_row(model, world, hw, f1, "1F1B over FSDP (pp 4, shard 8)"),
        zeropp_row(model, world, hw, {**f1, "activation_checkpointing": "all", "reshard_after_forward": True},
                   "memory-efficient 1F1B over FSDP (the same, full recomputation, resharding after every forward)"),
        zeropp_row(model, world, hw, {"dp_shard_size": 8, "dp_replicate_size": world // 8,
                   "num_microbatches": 4}, "FSDP alone (shard 8, replicated across nodes), 4 micro-batches"),
        best_3d(model, world, hw),
    ]  # fmt: skip
    if not quick:
        best = search(
            model, world, ROWS_PER_GPU * world, SEQ, hw, base={"param_dtype": "bf16"}, top=1
        )[0]
        rows.append(zeropp_row(model, world, hw, {k: v for k, v in best.settings.items()
                                                  if k != "param_dtype"}, "the search's best"))  # fmt: skip
    for r in rows:
        r["fits"] = r["memory_GiB"] <= hw.memory_bytes / GiB
    return rows


def family(settings: dict[str, Any]) -> str:
    if settings.get("pp_size", 1) == 1:
        return "FSDP alone"
    return {
        "zeropp": "ZeroPP", "1f1b": "1F1B over FSDP",
        "interleaved_1f1b": "Interleaved 1F1B over FSDP", "zbv": "ZB-V over FSDP",
    }[settings["schedule"]]  # fmt: skip


def memory_sweep(model: Any, compiled: bool, world: int = 32) -> dict[str, Any]:
    """The fastest layout of each family under each memory budget (per GPU), 32 GPUs, eager
    or with compile=True (`plan.hardware.compile_mode`; Megatron's fused kernels count as
    compiled)."""
    from dataclasses import replace

    from lightning_zeropp.plan.megatron import predict_3d
    from lightning_zeropp.plan.search import search
    from lightning_zeropp.plan.steptime import predict_range

    hw = replace(hardware(world // 8), memory_bytes=None)
    batch = ROWS_PER_GPU * world
    every = search(
        model, world, batch, SEQ, hw, base={"param_dtype": "bf16"}, top=10**6, compiled=compiled
    )
    layouts = [
        {"family": family(c.settings), "title": _describe(c.settings), "settings": c.settings,
         "step_s": c.step_s, "mfu": c.step.mfu, "memory_GiB": c.memory_bytes / GiB}
        for c in every
    ]  # fmt: skip
    for tp in (2, 4, 8):
        for pp in (1, 2, 4):
            for v in (1, 2) if pp > 1 else (1,):
                for recompute in (False, True):
                    dp = world // (tp * pp)
                    r = predict_3d(model, world, batch, SEQ, hw.at(compiled), tp=tp, pp=pp,
                                   num_chunks=v, num_microbatches=batch // dp,
                                   recompute=recompute)  # fmt: skip
                    layouts.append({
                        "family": "3D (Megatron-style, TP)", "step_s": r.step_s, "mfu": r.mfu,
                        "memory_GiB": r.memory_bytes / GiB, "settings": r.__dict__,
                        "title": f"TP {tp} x PP {pp}{f' (v {v})' if v > 1 else ''} x DP {dp}"
                        f"{', full recompute' if recompute else ''}",
                    })  # fmt: skip
    table: dict[str, dict[int, Any]] = {f: {} for f in FAMILIES}
    for budget in BUDGETS_GIB:
        for name in FAMILIES:
            fits = [x for x in layouts if x["family"] == name and x["memory_GiB"] <= budget]
            table[name][budget] = min(fits, key=lambda x: x["step_s"]) if fits else None
    # the ends of the efficiency range for the winner at each budget
    for budget in BUDGETS_GIB:
        best = min((table[f][budget] for f in FAMILIES if table[f][budget]),
                   key=lambda x: x["step_s"], default=None)  # fmt: skip
        if best and best["family"] != "3D (Megatron-style, TP)":
            from lightning_zeropp.core import ZeroPPConfig

            fast_slow = predict_range(
                model, ZeroPPConfig(**best["settings"]), world, batch, SEQ, hw, compiled=compiled
            )
            best["range_s"] = [fast_slow[1].step_s, fast_slow[0].step_s]
    return {"world": world, "budgets_GiB": list(BUDGETS_GIB), "table": table,
            "layouts_priced": len(layouts), "compiled": compiled}  # fmt: skip


def _describe(settings: dict[str, Any]) -> str:
    from lightning_zeropp.plan.__main__ import describe

    return describe(settings)


def sweep_u_v(model: Any) -> list[dict]:
    hw = hardware(4)
    out = []
    for v in (2, 4, 8):
        for u in (4, 8, 16):
            s = {"pp_size": 4, "dp_shard_size": 8, "schedule": "zeropp", "num_chunks": v,
                 "unit_size": u, "num_microbatches": 16}  # fmt: skip
            out.append({"v": v, "u": u, **zeropp_row(model, 32, hw, s, "")})
    return out


def scaling(model: Any, quick: bool) -> list[dict]:
    from lightning_zeropp.plan.megatron import predict_3d

    out = []
    worlds = (8, 32, 128) if quick else (8, 16, 32, 64, 128, 256, 512, 1024)
    for world in worlds:
        hw = hardware(max(world // 8, 1))
        pp = 4 if world >= 32 else world // 8 if world >= 16 else 2
        shard = min(8, world // pp)
        rep = world // (pp * shard)
        m = ROWS_PER_GPU * world // (shard * rep)
        layouts = {
            "ZeroPP": {"pp_size": pp, "dp_shard_size": shard, "dp_replicate_size": rep,
                       "schedule": "zeropp", "num_chunks": 4, "unit_size": 4, "num_microbatches": m},
            "1F1B over FSDP": {"pp_size": pp, "dp_shard_size": shard, "dp_replicate_size": rep,
                               "schedule": "1f1b", "num_microbatches": m},
            "FSDP alone": {"dp_shard_size": 8, "dp_replicate_size": world // 8, "num_microbatches": 4},
        }  # fmt: skip
        row: dict[str, Any] = {"world": world}
        for name, settings in layouts.items():
            best = None
            for recompute in ("none", "except_last" if name == "ZeroPP" else "all"):
                r = zeropp_row(
                    model, world, hw, {**settings, "activation_checkpointing": recompute}, ""
                )
                if r["memory_GiB"] * GiB <= hw.memory_bytes and (
                    best is None or r["step_s"] < best["step_s"]
                ):
                    best = r
            row[name] = best["mfu"] if best else None
        tp_pp = 4 if world >= 32 else 1
        three = predict_3d(model, world, ROWS_PER_GPU * world, SEQ, hw, tp=8, pp=tp_pp,
                           num_microbatches=ROWS_PER_GPU * world // (world // (8 * tp_pp)),
                           recompute=False)  # fmt: skip
        row["3D (TP 8)"] = three.mfu if three.memory_bytes <= hw.memory_bytes else None
        out.append(row)
        print(
            f"scaling {world}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "world" and v),
            flush=True,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="no search, 3 scaling points")
    args = parser.parse_args()
    import torch

    from lightning_zeropp.models.hf import build_causal_lm

    started = time.monotonic()
    where = machine()  # before this run writes its results (they would read as uncommitted)
    with torch.device("meta"):
        model = build_causal_lm("llama", **LLAMA_7B)
    tables = {}
    for world in (32, 64):
        tables[world] = rows_for(model, world, args.quick)
        print(f"{world} GPUs done ({time.monotonic() - started:.0f}s)", flush=True)
    sweep = sweep_u_v(model)
    scale = scaling(model, args.quick)
    memory = [memory_sweep(model, compiled) for compiled in (False, True)]
    print(f"memory sweeps done ({time.monotonic() - started:.0f}s)", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(sweep, scale, RESULTS / "paper_claims.png", RESULTS / "paper_scaling.png")
    plot_memory(memory, RESULTS / "paper_memory.png")
    meta = {"machine": where, "seq_len": SEQ, "rows_per_gpu": ROWS_PER_GPU,
            "wall_s": round(time.monotonic() - started, 1)}  # fmt: skip
    (RESULTS / "paper_claims.json").write_text(
        json.dumps(
            {**meta, "tables": tables, "sweep": sweep, "scaling": scale, "memory": memory},
            indent=1, default=str,
        )
    )  # fmt: skip
    write_markdown(meta, tables, sweep, scale, RESULTS / "paper_claims.md", memory)
    print((RESULTS / "paper_claims.md").read_text())


if __name__ == "__main__":
    main()
