"""compile=True against eager, per schedule, on 2 CPU gloo ranks (pp 2).

    python bench/bench_compile.py [--schedules zeropp,zbv,...] [--steps 6] [--warmup 3]

Rows: every schedule (gpipe, 1f1b, interleaved_1f1b, zbv, interleaved_zb, dualpipev, zeropp with
its split backward), eager and compiled (whole blocks under the full-backward schedules, the regions
between the weights under the split-backward ones: `core.shard.compile`), each in its own fresh
processes: the same GPT, data and initial weights, AdamW, fp32. The first warm-up step compiles;
its time is reported apart. Per schedule: median step time (slowest rank) compiled / eager, the
loss difference after the run, and how often compiled code ran per step (0 would mean it did not).
Inductor's C++ backend on CPU; the ranks' compile caches (inductor's FX graph cache) persist
across rows and runs. Written to bench/results/compile.md and .json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch_ranks, machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
MODEL = {"vocab_size": 256, "seq_len": 64, "dim": 128, "num_heads": 4, "num_layers": 8}
GLOBAL_BATCH = 16
MICROBATCHES = 4
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "interleaved_zb", "dualpipev", "zeropp")


def layout(schedule: str, compiled: bool) -> dict[str, Any]:
    return {
        "pp_size": 2,
        "schedule": schedule,
        "num_microbatches": MICROBATCHES,
        "compile": compiled,
    }


# ---------------------------------------------------------------------------------------- rank
def run_rank(row: str, steps: int, warmup: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_zeropp import launch_layout
    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
    from lightning_zeropp.core._torch_private import set_compile_threads
    from lightning_zeropp.core.shard.compile import compile_stats
    from lightning_zeropp.models import GPT, GPTConfig

    torch.set_num_threads(1)
    set_compile_threads(1)  # two ranks on two cores: no compile worker pool per rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    schedule, mode = row.rsplit(":", 1)
    config = ZeroPPConfig(**layout(schedule, mode == "compiled")).resolve(2)
    torch.manual_seed(0)
    micro = GLOBAL_BATCH // config.num_microbatches
    example = (torch.zeros(micro, MODEL["seq_len"], dtype=torch.long),)

    def loss_fn(logits: Any, targets: Any) -> Any:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    engine = ZeroPPEngine(
        GPT(GPTConfig(**MODEL)),
        launch_layout(config),
        loss_fn=loss_fn,
        split="call",
        example_args=example,
    )
    opt = torch.optim.AdamW(engine.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(
        0, MODEL["vocab_size"], (GLOBAL_BATCH, MODEL["seq_len"] + 1), generator=gen
    )
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    times, cpu, losses = [], [], []
    for _ in range(warmup + steps):
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = engine.train_step(x, target=y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
        losses.append(float(loss))
    step_times = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(step_times, op=dist.ReduceOp.MAX)
    stats = compile_stats()
    result = {
        "rank": dist.get_rank(),
        "step_times_s": step_times.tolist(),
        "cpu_times_s": cpu,
        "losses": losses,
        "compiled_runs_per_step": (stats.get("whole_runs", 0) + stats.get("split_runs", 0))
        / (warmup + steps),
        "compile_stats": stats,
    }
    partial = out / f"rank{result['rank']}.json.partial"
    partial.write_text(json.dumps(result))
    partial.rename(out / f"rank{result['rank']}.json")
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- driver
def summarize(row: str, ranks: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    times = ranks[0]["step_times_s"]
    # CPU seconds per step, summed over the ranks: the work itself, which a loaded machine's
    # time-slicing does not stretch (waiting for a core or a message costs none)
    cpu = [sum(r["cpu_times_s"][i] for r in ranks) for i in range(len(times))]
    return {
        "row": row,
        "first_step_s": times[0],
        "median_step_s": statistics.median(times[warmup:]),
        "median_cpu_s": statistics.median(cpu[warmup:]),
        "step_times_s": times,
        "final_loss": ranks[0]["losses"][-1],
        "compiled_runs_per_step": min(r["compiled_runs_per_step"] for r in ranks),
        "fallbacks": sum(r["compile_stats"].get("fallbacks", 0) for r in ranks),
        "compile_stats": [r["compile_stats"] for r in ranks],
    }


def write_markdown(meta: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    m = meta["machine"]
    by = {r["row"]: r for r in rows}
    out = [
        "# compile=True against eager, per schedule (CPU gloo, pp 2)",
        "",
        f"{m['date']}, commit {m['commit']}, {m['cpu']} ({m['cores']} cores, load average "
        f"{m['load_average_1m_at_start']:.1f} at the start), torch {m['torch']}.",
        f"GPT {meta['model']}, global batch {meta['global_batch']}, {MICROBATCHES} micro-batches, "
        f"AdamW, fp32, split='call'; {meta['steps']} timed steps after {meta['warmup']} warm-up "
        f"(the first compiles); run took {meta['wall_s']} s. `python bench/bench_compile.py`.",
        "",
        *(
            [
                f"**Loaded machine (load average {m['load_average_1m_at_start']:.0f} on "
                f"{m['cores']} cores): the times below are not comparable.**",
                "",
            ]
            if m["load_average_1m_at_start"] > m["cores"]
            else []
        ),
        "| schedule | compiled as | eager step (s) | compiled step (s) | compiled / eager | "
        "eager CPU s | compiled CPU s | CPU compiled / eager | first compiled step (s) | "
        "compiled runs / step | loss diff | fallbacks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for schedule in meta["schedules"]:
        eager, comp = by.get(f"{schedule}:eager"), by.get(f"{schedule}:compiled")
        if eager is None or comp is None:
            continue
        stats = comp["compile_stats"][0]
        mode = "regions" if stats.get("split_runs") else "whole blocks"
        out.append(
            f"| {schedule} | {mode} | {eager['median_step_s']:.4f} | {comp['median_step_s']:.4f} | "
            f"{comp['median_step_s'] / eager['median_step_s']:.3f} | "
            f"{eager['median_cpu_s']:.4f} | {comp['median_cpu_s']:.4f} | "
            f"{comp['median_cpu_s'] / eager['median_cpu_s']:.3f} | {comp['first_step_s']:.1f} | "
            f"{comp['compiled_runs_per_step']:.1f} | "
            f"{abs(comp['final_loss'] - eager['final_loss']):.1e} | {comp['fallbacks']} |"
        )
    out += ["", "## Reading it", "", *CAVEATS]
    path.write_text("\n".join(out) + "\n")


CAVEATS = [
    "- Two ranks share two CPU cores: with other work on the machine (a load average above the "
    "core count) the step times swing by several times between rows doing the same work, and "
    "their ratio means nothing; rerun on a quiet machine. The CPU columns (CPU seconds per step, "
    "summed over both ranks, median over the timed steps) count the work itself, which waiting "
    "for a core does not stretch; cache and memory contention still move them (by up to a third "
    "between whole-block rows running the same compiled code, on a machine at load 38).",
    "- On a CPU, a block of this size spends most of its time in matmuls, which are the same "
    "library calls compiled or not: expect ratios near 1. What the table can show is whether the "
    "split-backward schedules (regions) cost more than eager, which would point at the cut "
    "(extra pieces, each with its own call overhead); what compiling gains is a GPU's question "
    "(`bench/gpu/run.sh`).",
    "- 'regions' (split-backward schedules): every op reading a weight runs eagerly, so "
    "LayerNorm (one op with its scale and bias) and the linears stay eager and the compiled "
    "regions hold the attention, activation and residual arithmetic between them.",
    "- 'compiled runs / step' counts executions of compiled graphs per step on the rank that "
    "counted fewest (one per block and micro-batch forward, plus the first step's shape "
    "inference); 0 would mean that nothing compiled ran.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        run_rank(args.worker, args.steps, args.warmup, Path(args.out))
        return
    start = time.monotonic()
    schedules = args.schedules.split(",")
    rows = []
    for schedule in schedules:
        for mode in ("eager", "compiled"):
            t0, row = time.monotonic(), f"{schedule}:{mode}"
            worker_args = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            ranks = launch_ranks(__file__, row, 2, worker_args, timeout_s=900)
            rows.append(summarize(row, ranks, args.warmup))
            print(
                f"{row}: median step {rows[-1]['median_step_s']:.4f}s, first "
                f"{rows[-1]['first_step_s']:.1f}s ({time.monotonic() - t0:.0f}s)",
                flush=True,
            )
    meta = {
        "machine": machine(),
        "model": MODEL,
        "global_batch": GLOBAL_BATCH,
        "schedules": schedules,
        "steps": args.steps,
        "warmup": args.warmup,
        "wall_s": round(time.monotonic() - start, 1),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compile.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    write_markdown(meta, rows, RESULTS / "compile.md")
    print((RESULTS / "compile.md").read_text())


if __name__ == "__main__":
    main()
