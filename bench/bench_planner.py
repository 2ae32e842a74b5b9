"""The step-time model against measurement: predicted vs measured step time on CPU gloo ranks.

    python bench/bench_planner.py [--steps 4] [--warmup 2] [--rows fsdp_m1,1f1b,...]

Calibration first, on this machine (what the model is told; no step time is fitted):
- compute: (a) the rate of one 1024^3 fp32 matmul on one thread ("matmul rate"), and (b) each
  stage's forward and backward of one micro-batch, timed on real tensors on one thread in this
  process ("profiled stages", the planner's `stage_seconds`);
- links: 2 gloo ranks time all-gathers, reduce-scatters and send/recv of 64 KiB..4 MiB, and a
  least-squares line gives latency and bandwidth;
- memory bandwidth: a large copy (the optimizer step streams the state).
Then each row trains the GPT of `bench_layouts.py` on fresh gloo ranks (one thread each; 2 ranks
on 2 cores, and 4-rank rows where two ranks share a core, told to the model as half the rate) and
its median step is compared with `plan.predict_step_time` under both compute calibrations.
Writes bench/results/planner.md and planner.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch_ranks, machine  # noqa: E402
from planner_calibration import (  # noqa: E402
    GLOBAL_BATCH,
    MODEL,
    PG_TIMEOUT,
    SIZES,
    TRAIN,
    Layout,
    calibrate_rank,
    fit_line,
    overhead_rank,
    profile_stages,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
ROWS: dict[str, tuple[int, Layout]] = {
    "fsdp_m1": (2, {"dp_shard_size": 2}),
    "fsdp_m4": (2, {"dp_shard_size": 2, "num_microbatches": 4}),
    "gpipe": (2, {"pp_size": 2, "schedule": "gpipe", "num_microbatches": 4}),
    "1f1b": (2, {"pp_size": 2, "schedule": "1f1b", "num_microbatches": 4}),
    "1f1b_m8": (2, {"pp_size": 2, "schedule": "1f1b", "num_microbatches": 8}),
    "interleaved": (2, {"pp_size": 2, "schedule": "interleaved_1f1b", "num_microbatches": 4}),
    "zbv": (2, {"pp_size": 2, "schedule": "zbv", "num_microbatches": 4}),
    "zeropp": (2, {"pp_size": 2, "schedule": "zeropp", "num_microbatches": 4}),
    "zeropp_u4_m8": (
        2,
        {"pp_size": 2, "schedule": "zeropp", "num_microbatches": 8, "unit_size": 4},
    ),
    "4r_1f1b": (4, {"pp_size": 2, "dp_shard_size": 2, "schedule": "1f1b", "num_microbatches": 4}),
    "4r_zeropp": (
        4,
        {"pp_size": 2, "dp_shard_size": 2, "schedule": "zeropp", "num_microbatches": 4},
    ),
}


# Rows whose every collective and message crosses the emulated link (2 nodes of 1 rank).
EMULATED = ("fsdp_m1", "fsdp_m4", "1f1b", "zeropp", "zbv")


def row_timeout_s(steps: int, warmup: int) -> float:
    return 120.0 + 20.0 * (warmup + steps)


# ---------------------------------------------------------------------------------------- ranks
def train_rank(row: str, steps: int, warmup: int, out: Path) -> None:
    """One rank of one row: train, time each step (slowest rank), write this rank's JSON."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_zeropp import launch_layout
    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
    from lightning_zeropp.core.measure.timeline import StepRecorder
    from lightning_zeropp.models import GPT, GPTConfig
    from lightning_zeropp.plan.hardware import measure_optimizer_rate

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    world, layout = ROWS[row]
    # calibration on every rank at once, so each sees the contention it trains under
    dist.barrier()
    profile = profile_stages(world, layout)
    optimizer_rate = measure_optimizer_rate()
    config = ZeroPPConfig(**layout).resolve(world)
    cfg = GPTConfig(**MODEL)
    torch.manual_seed(0)
    micro = GLOBAL_BATCH // config.dp_size // config.num_microbatches
    example = (torch.zeros(micro, cfg.seq_len, dtype=torch.long),)
    engine = ZeroPPEngine(
        GPT(cfg),
        launch_layout(config),
        loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
        split="stack",
        example_args=example,
    )
    opt = torch.optim.AdamW(list(engine.parameters()), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, cfg.seq_len + 1))
    per = GLOBAL_BATCH // config.dp_size
    rows = slice(engine.dims.dp_rank * per, (engine.dims.dp_rank + 1) * per)
    x, y = tokens[rows, :-1].contiguous(), tokens[rows, 1:].contiguous()
    times, optimizer, warmup_optimizer = [], [], []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        engine.train_step(x, target=y)
        mid = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            optimizer.append(time.perf_counter() - mid)
        elif i > 0:  # the calibration: optimizer steps of the untimed steps (not the first)
            warmup_optimizer.append(time.perf_counter() - mid)
    with StepRecorder(engine) as recorder:  # one more step, recorded (not timed): where time went
        engine.train_step(x, target=y)
    opt.zero_grad(set_to_none=True)
    spent: dict[str, float] = {}
    for i in recorder.timeline.intervals:
        key = f"{i.lane}:{i.kind}"
        spent[key] = spent.get(key, 0.0) + i.end - i.start
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    rank = dist.get_rank()
    result = {
        "rank": rank, "times": slowest.tolist(), "optimizer": optimizer,
        "profile": profile, "optimizer_rate": optimizer_rate,
        "warmup_optimizer": warmup_optimizer, "recorded": spent,
        "recorded_step": recorder.timeline.end(),
    }  # fmt: skip
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- driver
def predict(
    world: int, layout: Layout, hw: Any, stage_seconds: Any, optimizer_s: float | None
) -> float:
    import torch

    from lightning_zeropp.core import ZeroPPConfig
    from lightning_zeropp.models import GPT, GPTConfig
    from lightning_zeropp.plan import predict_step_time

    with torch.device("meta"):
        model = GPT(GPTConfig(**MODEL))
    plan = predict_step_time(
        model, ZeroPPConfig(**layout), world, GLOBAL_BATCH, MODEL["seq_len"], hw,
        stage_seconds=stage_seconds, optimizer_seconds=optimizer_s,
    )  # fmt: skip
    return plan.step_s


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument(
        "--emulated",
        type=float,
        default=None,
        metavar="MBIT",
        help="2 ranks on 2 emulated nodes joined by a MBIT link (needs root)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "calibrate":
        calibrate_rank(Path(args.out), SIZES)
        return
    if args.worker == "overhead":
        overhead_rank(Path(args.out))
        return
    if args.worker:
        train_rank(args.worker, args.steps, args.warmup, Path(args.out))
        return
    import torch

    from lightning_zeropp.plan.hardware import measure_matmul_rate, measure_memory_bandwidth

    torch.set_num_threads(1)
    started = time.monotonic()
    where = machine()  # before this run writes its results (they would read as uncommitted)
    names = [r for r in args.rows.split(",") if r]
    placement, suffix = None, ""
    if args.emulated:
        from netns import EmulatedCluster, unavailable

        why = unavailable()
        if why:
            raise SystemExit(f"--emulated: {why}")
        names = [n for n in names if ROWS[n][0] == 2 and n in EMULATED]
        placement = EmulatedCluster(nodes=2, ranks_per_node=1, inter_mbit=args.emulated)
        suffix = "_emulated"
    with placement or contextlib.nullcontext():
        sizes = SIZES
        ranks = launch_ranks(__file__, "calibrate", 2, [], 600.0, placement=placement)
        # the receiver's times: a send returns once the kernel has queued it
        calib = {
            k: [max(r["times"][k][i] for r in ranks) for i in range(len(sizes))]
            for k in ranks[0]["times"]
        }
        links = {name: fit_line(sizes, seconds) for name, seconds in calib.items()}
        links["all_reduce"] = links["reduce_scatter"]  # not used: no HSDP row here
        overhead = launch_ranks(__file__, "overhead", 1, [], 180.0)[0]
        print("links:", links, "engine overhead:", overhead, flush=True)
        rate, memory = measure_matmul_rate(), measure_memory_bandwidth()
        rows = [run_row(name, args, placement, links, overhead, rate, memory) for name in names]
    meta = {
        "machine": where, "model": MODEL, "global_batch": GLOBAL_BATCH,
        "steps": args.steps, "warmup": args.warmup, "matmul_rate_flops": rate,
        "memory_Bps": memory, "links": links, "wall_s": round(time.monotonic() - started, 1),
        "overhead": overhead, "emulated_mbit": args.emulated,
    }  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"planner{suffix}.json"
    out.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    write_markdown(meta, rows, RESULTS / f"planner{suffix}.md")
    print((RESULTS / f"planner{suffix}.md").read_text())


def run_row(
    name: str,
    args: argparse.Namespace,
    placement: Any,
    links: dict[str, tuple[float, float]],
    overhead: dict[str, Any],
    rate: float,
    memory: float,
) -> dict[str, Any]:
    """Train one row, then predict it from the calibration and the ranks' own stage times."""
    from lightning_zeropp.plan.hardware import Hardware

    world, layout = ROWS[name]
    share = 2 / max(world, 2)  # ranks per core: 4 ranks on 2 cores get half each
    t0 = time.monotonic()
    extra = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    ranks = launch_ranks(__file__, name, world, extra, row_timeout_s(args.steps, args.warmup) * 3,
                         placement=placement)  # fmt: skip
    measured = statistics.median(ranks[0]["times"])
    latency, bandwidth = links["p2p"]
    hw = Hardware(
        flops_per_s=rate * share, intra_node_Bps=bandwidth, inter_node_Bps=bandwidth,
        node_size=world, latency_s=latency, memory_Bps=memory * share, overlap=False,
        optimizer_Bps=min(r["optimizer_rate"] for r in ranks), collectives=links,
        unit_overhead_s=overhead["unit_overhead_s"] / share,
    )  # fmt: skip
    optimizer_s = max(statistics.median(r["warmup_optimizer"]) for r in ranks)
    # each stage as the slowest rank timed it, all ranks timing at once
    profiled = [
        tuple(max(r["profile"][s][i] for r in ranks) for i in range(2))
        for s in range(len(ranks[0]["profile"]))
    ]
    by_rate = predict(world, layout, hw, None, None)
    by_profile = predict(world, layout, hw, profiled, optimizer_s)
    print(f"{name}: measured {measured:.3f}s, predicted {by_profile:.3f}s (profiled) "
          f"{by_rate:.3f}s (matmul rate) [{time.monotonic() - t0:.0f}s]", flush=True)  # fmt: skip
    return {
        "row": name, "world": world, "layout": layout, "measured_s": measured,
        "times_s": ranks[0]["times"], "predicted_profiled_s": by_profile,
        "predicted_matmul_rate_s": by_rate, "stage_seconds": profiled,
        "optimizer_measured_s": max(statistics.median(r["optimizer"]) for r in ranks),
        "optimizer_rate_Bps": hw.optimizer_rate,
        "recorded": [{**r["recorded"], "step": r["recorded_step"]} for r in ranks],
    }  # fmt: skip


def write_markdown(meta: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    m = meta["machine"]
    lines = [
        "# Step-time model vs measured step, CPU gloo ranks"
        + (
            f" on 2 emulated nodes ({meta['emulated_mbit']:g} Mbit/s link)"
            if meta.get("emulated_mbit")
            else ""
        ),
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores; one thread per rank",
        f"- Date: {m['date']}; torch {m['torch']}; commit {m['commit']}",
        f"- Model: GPT {meta['model']}, fp32, global batch {meta['global_batch']}, AdamW; "
        f"{meta['warmup']} warm-up and {meta['steps']} timed steps per row (median of the slowest rank)",
        f"- Calibration: matmul {meta['matmul_rate_flops'] / 1e9:.1f} GFLOP/s per thread; memory "
        f"copy {meta['memory_Bps'] / 1e9:.1f} GB/s; gloo, trains of {TRAIN} calls of 4 KiB..4 "
        "MiB (latency from the smallest, bandwidth from the two largest, a hop): "
        + "; ".join(
            f"{k} {lat * 1e6:.0f} us, {bw / 1e9:.2f} GB/s"
            for k, (lat, bw) in meta["links"].items()
            if k != "all_reduce"
        )
        + f"; the engine's fixed cost {meta['overhead']['unit_overhead_s'] * 1e6:.0f} us per FSDP "
        "unit and task",
        "",
        "| Row | Ranks | Layout | Measured (s) | Predicted, profiled stages (s) | Error | "
        "Predicted, matmul rate (s) | Error |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        e1 = r["predicted_profiled_s"] / r["measured_s"] - 1
        e2 = r["predicted_matmul_rate_s"] / r["measured_s"] - 1
        layout = ", ".join(f"{k}={v}" for k, v in r["layout"].items())
        lines.append(
            f"| {r['row']} | {r['world']} | {layout} | {r['measured_s']:.3f} | "
            f"{r['predicted_profiled_s']:.3f} | {e1:+.1%} | {r['predicted_matmul_rate_s']:.3f} | {e2:+.1%} |"
        )
    errors = {r["row"]: r["predicted_profiled_s"] / r["measured_s"] - 1 for r in rows}
    outside = [f"{name} ({e:+.1%})" for name, e in errors.items() if abs(e) > 0.15]
    lines += [
        "",
        f"Within 15% of the measured step with profiled stages: {len(rows) - len(outside)} of "
        f"{len(rows)} rows"
        + (f"; outside: {', '.join(outside)}." if outside else ".")
        + " From a large matmul's rate alone: "
        + ", ".join(f"{r['predicted_matmul_rate_s'] / r['measured_s'] - 1:+.0%}" for r in rows)
        + " (this small model's layers run well below a large matmul's rate).",
    ]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
