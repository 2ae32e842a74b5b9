"""DDP vs FSDP2 vs 1F1B-over-FSDP2 on 4 CPU gloo ranks: step time, memory and traffic per step.

    python bench/bench_layouts.py [--steps 6] [--warmup 2] [--rows ddp,fsdp2,pp_1f1b]

Every row trains the same GPT on the same global batch with AdamW, in its own 4 fresh processes
(so each row's peak RSS is its own), launched by this script. Results are written to
bench/results/layouts.md and bench/results/layouts.json (both overwritten). See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch_ranks, machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
WORLD = 4
MODEL = {"vocab_size": 256, "seq_len": 128, "dim": 256, "num_heads": 4, "num_layers": 8}
GLOBAL_BATCH = 32
ROWS: dict[str, dict[str, Any]] = {
    "ddp": {"title": "DDP (dp=4)", "layout": None},
    "fsdp2": {"title": "FSDP2 (dp_shard=4)", "layout": {"dp_shard_size": 4}},
    "pp_1f1b": {
        "title": "PP 1F1B over FSDP2 (pp=2, dp_shard=2, 4 micro-batches)",
        "layout": {"pp_size": 2, "dp_shard_size": 2, "schedule": "1f1b", "num_microbatches": 4},
    },
}
PG_TIMEOUT = datetime.timedelta(seconds=120)
MIB = 2**20


def row_timeout_s(steps: int, warmup: int) -> float:
    """Start-up plus a generous 20 s a step (a step takes about 2 s on 2 cores)."""
    return 120.0 + 20.0 * (warmup + steps + 1)


# ---------------------------------------------------------------------------------------- rank
def run_rank(row: str, steps: int, warmup: int, out: Path) -> None:
    """One rank of one row: train, time, count traffic, and write this rank's JSON."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.tensor import DTensor

    from lightning_zeropp import launch_layout
    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
    from lightning_zeropp.core.measure.axes import mesh_axis_namer
    from lightning_zeropp.core.measure.comm import CommCounter
    from lightning_zeropp.models import GPT, GPTConfig

    # A rank still running near the row's deadline prints where it is stuck into its log.
    faulthandler.dump_traceback_later(row_timeout_s(steps, warmup) - 15, exit=False)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    rank = dist.get_rank()
    rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    cfg = GPTConfig(**MODEL)
    torch.manual_seed(0)
    model = GPT(cfg)
    layout = ROWS[row]["layout"]
    if layout is None:  # plain DDP over the whole world
        dp_size, dp_rank = WORLD, rank
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        # DDP's reducer all-reduces from C++; this hook (its documented equivalent) routes the
        # bucket all-reduces through dist.all_reduce so CommCounter sees them.
        ddp.register_comm_hook(None, allreduce_hook)
        params = list(ddp.parameters())
        namer = None

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(ddp(x), y)
            loss.backward()
            return loss
    else:
        config = ZeroPPConfig(**layout).resolve(WORLD)
        dp_size = config.dp_size
        micro = GLOBAL_BATCH // dp_size // config.num_microbatches
        example = (torch.zeros(micro, cfg.seq_len, dtype=torch.long),)
        # "stack" (GPT keeps its blocks in one ModuleList) gives each stage the same layers as the
        # default "trace", without ~25 s of torch.export per row on this machine.
        engine = ZeroPPEngine(
            model, launch_layout(config), loss_fn=loss_fn, split="stack", example_args=example
        )
        dp_rank = engine.dims.dp_rank
        params = list(engine.parameters())
        namer = mesh_axis_namer(engine.dims.mesh)

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return engine.train_step(x, target=y)

    del model  # the engine holds its own stage copies; DDP wraps the model in place
    opt = torch.optim.AdamW(params, lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, cfg.seq_len + 1), generator=gen)
    per_rank = GLOBAL_BATCH // dp_size
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    x, y = tokens[rows, :-1].contiguous(), tokens[rows, 1:].contiguous()

    def local_bytes(t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    times, losses = [], []
    cpu_start = wall_start = 0.0
    for i in range(warmup + steps + 1):
        if i == warmup:
            cpu_start, wall_start = time.process_time(), time.perf_counter()
        counted = i == warmup + steps  # one extra step, counted, so counting never skews timing
        dist.barrier()  # start every step together: the time is the step's, not the skew's
        start = time.perf_counter()
        if counted:
            with CommCounter(namer) as comm:
                loss = train_step(x, y)
                opt.step()
        else:
            loss = train_step(x, y)
            opt.step()
        elapsed = time.perf_counter() - start
        losses.append(loss.detach())
        if i >= warmup and not counted:
            times.append(elapsed)
        if i == warmup + steps - 1:
            cpu_s, wall_s = time.process_time() - cpu_start, time.perf_counter() - wall_start
        if counted:  # what the rank holds after a step, before the gradients are dropped
            held = {
                "params": sum(local_bytes(p) for p in params),
                "grads": sum(local_bytes(p.grad) for p in params),
                "optim": sum(
                    local_bytes(v)
                    for state in opt.state.values()
                    for v in state.values()
                    if isinstance(v, torch.Tensor)
                ),
            }
        opt.zero_grad(set_to_none=True)
    # A step takes as long as its slowest rank.
    step_times = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(step_times, op=dist.ReduceOp.MAX)
    loss_curve = torch.stack(losses).float()
    if layout is None:  # DDP's loss is this rank's; the engine's is already the global mean
        dist.all_reduce(loss_curve)
        loss_curve /= WORLD
    rss_after_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = {
        "rank": rank,
        "step_times_s": step_times.tolist(),
        "losses": loss_curve.tolist(),
        "timed_cpu_s": cpu_s,
        "timed_wall_s": wall_s,
        "peak_rss_delta_bytes": (rss_after_kib - rss_before_kib) * 1024,
        "peak_rss_bytes": rss_after_kib * 1024,
        "held_bytes": held,
        "comm": comm.summary(),
    }
    partial = out / f"rank{rank}.json.partial"  # the driver watches for the complete file
    partial.write_text(json.dumps(result))
    partial.rename(out / f"rank{rank}.json")
    faulthandler.dump_traceback_later(10, exit=False)  # tell where teardown hangs, if it does
    dist.barrier()  # tear down together: no rank destroys its group while a peer still uses it
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- driver
def launch(row: str, steps: int, warmup: int) -> list[dict[str, Any]]:
    args = ["--steps", str(steps), "--warmup", str(warmup)]
    return launch_ranks(__file__, row, WORLD, args, row_timeout_s(steps, warmup))


def summarize(row: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    step_times = ranks[0]["step_times_s"]  # already the max over ranks, step by step
    comm: dict[str, dict[str, Any]] = {}
    for r in ranks:
        for kind, axes in r["comm"].items():
            for axis, stats in axes.items():
                entry = comm.setdefault(
                    f"{kind}@{axis}", {"kind": kind, "axis": axis, "per_rank": {}}
                )
                entry["per_rank"][r["rank"]] = stats
    for entry in comm.values():
        per_rank = [entry["per_rank"].get(r, {"count": 0, "bytes": 0}) for r in range(WORLD)]
        entry["bytes_mean"] = statistics.fmean(s["bytes"] for s in per_rank)
        entry["bytes_max"] = max(s["bytes"] for s in per_rank)
        entry["count_max"] = max(s["count"] for s in per_rank)
    # The ranks' CPU time over the timed steps per core-second of wall time: near 1 when they had
    # the cores to themselves, lower when other work on the machine took a share.
    cpu_share = sum(r["timed_cpu_s"] for r in ranks) / (
        max(r["timed_wall_s"] for r in ranks) * (os.cpu_count() or 1)
    )
    return {
        "row": row,
        "cpu_share": cpu_share,
        "title": ROWS[row]["title"],
        "layout": ROWS[row]["layout"],
        "median_step_s": statistics.median(step_times),
        "step_times_s": step_times,
        "final_loss": ranks[0]["losses"][-1],
        "peak_rss_delta_max_bytes": max(r["peak_rss_delta_bytes"] for r in ranks),
        "peak_rss_max_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "held_max_bytes": {
            k: max(r["held_bytes"][k] for r in ranks) for k in ranks[0]["held_bytes"]
        },
        "comm_per_step": dict(sorted(comm.items())),
        "ranks": ranks,
    }


def mib(n: float) -> str:
    return f"{n / MIB:.1f}"


def write_markdown(meta: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    m = meta["machine"]
    lines = [
        "# Layouts: DDP vs FSDP2 vs PP 1F1B over FSDP2",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores; {WORLD} gloo ranks, OMP_NUM_THREADS=1 each",
        f"- Date: {m['date']}; torch {m['torch']}; Python {m['python']}; commit {m['commit']}",
        f"- Model: GPT {meta['model']}, fp32; global batch {GLOBAL_BATCH} sequences; AdamW",
        f"- {meta['warmup']} warm-up steps, {meta['steps']} timed steps (each: forward, backward, "
        "AdamW step), then 1 step counted with CommCounter (not timed)",
        "",
        "Step time: median (and range) over the timed steps of the slowest rank's time. CPU share: "
        "the ranks' CPU time over the timed steps per core-second of wall time (near 1: the ranks "
        f"had the {m['cores']} cores to themselves; lower: other work took a share, and the times "
        "are not comparable). "
        "Peak RSS: growth of "
        "ru_maxrss from after process-group init to the end, max over ranks. Held: parameters, "
        "gradients and AdamW state this rank holds after a step, analytic, max over ranks.",
        "",
        "| Layout | Median step (s) | Min-max (s) | CPU share | Peak RSS growth (MiB) | "
        "Params (MiB) | Grads (MiB) | AdamW state (MiB) | Final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        h, t = r["held_max_bytes"], r["step_times_s"]
        lines.append(
            f"| {r['title']} | {r['median_step_s']:.2f} | {min(t):.2f}-{max(t):.2f} | "
            f"{r['cpu_share']:.2f} | {mib(r['peak_rss_delta_max_bytes'])} | "
            f"{mib(h['params'])} | {mib(h['grads'])} | {mib(h['optim'])} | {r['final_loss']:.4f} |"
        )
    lines += [
        "",
        "Traffic per step and rank, by collective kind and mesh axis (CommCounter convention: "
        "all-gather counts the input shard, reduce-scatter the full input, all-reduce the tensor, "
        "send/recv the message; see `lightning_zeropp/core/measure/comm.py`). DDP's axis is the whole "
        "world (dp=4).",
        "",
        "| Layout | Kind | Axis | Calls (max over ranks) | MiB (mean over ranks) | MiB (max) |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        for c in r["comm_per_step"].values():
            lines.append(
                f"| {r['title']} | {c['kind']} | {c['axis']} | {c['count_max']} | "
                f"{c['bytes_mean'] / MIB:.2f} | {c['bytes_max'] / MIB:.2f} |"
            )
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of rows")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_rank(args.worker, args.steps, args.warmup, Path(args.out))
        return
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    names = [r for r in args.rows.split(",") if r]
    unknown = set(names) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from {list(ROWS)}")
    start = time.monotonic()
    rows = []
    for name in names:
        t0 = time.monotonic()
        rows.append(summarize(name, launch(name, args.steps, args.warmup)))
        print(
            f"{name}: median step {rows[-1]['median_step_s']:.2f}s ({time.monotonic() - t0:.0f}s)"
        )
    meta = {
        "machine": machine(),
        "model": MODEL,
        "global_batch": GLOBAL_BATCH,
        "world_size": WORLD,
        "steps": args.steps,
        "warmup": args.warmup,
        "wall_s": round(time.monotonic() - start, 1),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_markdown(meta, rows, RESULTS / "layouts.md")
    (RESULTS / "layouts.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print((RESULTS / "layouts.md").read_text())


if __name__ == "__main__":
    main()
