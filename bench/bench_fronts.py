"""The Lightning front vs the Accelerate front on 4 CPU gloo ranks: step time and peak memory.

    python bench/bench_fronts.py [--steps 6] [--warmup 2] [--repeats 3] [--rows lightning,accelerate,core]

The fronts train the same GPT, from the same initial weights, on the same global batch, in the same
layout (1F1B over FSDP2, pp 2 x dp_shard 2, 4 micro-batches), with AdamW and clipping at 1.0: the
only difference is the front (`Trainer(strategy=ZeroPPStrategy(...))` against `prepare_pipeline`
in a plain Accelerate loop); a third row runs the core engine with no front, the baseline both
add their overhead to. Each row runs in its own 4 fresh processes, launched by this script,
`--repeats` times, alternating the order (the machine is shared: a slow minute then hits all).
Results are written to bench/results/fronts.md and bench/results/fronts.json (both overwritten).
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
from common import launch_ranks  # noqa: E402
from common import machine as common_machine  # noqa: E402
from common import proc_stat as _proc_stat  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
WORLD = 4
MODEL = {"vocab_size": 256, "seq_len": 128, "dim": 256, "num_heads": 4, "num_layers": 8}
GLOBAL_BATCH = 32
LAYOUT = {"pp_size": 2, "dp_shard_size": 2, "schedule": "1f1b", "num_microbatches": 4}
DP = WORLD // LAYOUT["pp_size"]
LR, CLIP = 1e-3, 1.0
ROWS = {
    "lightning": "Lightning: Trainer(strategy=ZeroPPStrategy(...))",
    "accelerate": "Accelerate: prepare_pipeline(...) in a plain loop",
    "core": "No front: ZeroPPEngine in a plain torch loop (the baseline)",
}
PG_TIMEOUT = datetime.timedelta(seconds=120)
MIB = 2**20


def row_timeout_s(steps: int, warmup: int) -> float:
    """Start-up plus a generous 20 s a step (a step takes about 2 s on 2 cores)."""
    return 150.0 + 20.0 * (warmup + steps)


# ---------------------------------------------------------------------------------------- rank
def run_rank(row: str, steps: int, warmup: int, out: Path) -> None:
    """One rank of one row: train warm-up + timed steps and write this rank's JSON."""
    import torch

    faulthandler.dump_traceback_later(row_timeout_s(steps, warmup) - 15, exit=False)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    # The global batch, the same at every step (as in bench_layouts.py).
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(
        0, MODEL["vocab_size"], (GLOBAL_BATCH, MODEL["seq_len"] + 1), generator=gen
    )
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    # Before the front's imports, its process group and the model: growth from here is the row's.
    rss_start_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    clock = _Clock(warmup, steps)
    {"lightning": _lightning, "accelerate": _accelerate, "core": _core}[row](x, y, clock)
    import torch.distributed as dist

    times = torch.tensor(clock.times, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
    rss_end_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = {
        "rank": rank,
        "step_times_s": times.tolist(),
        "losses": clock.losses,
        "timed_cpu_s": clock.cpu_s,
        "timed_proc_stat": clock.proc_stat,
        "timed_wall_s": clock.wall_s,
        "peak_rss_bytes": rss_end_kib * 1024,
        "peak_rss_growth_bytes": (rss_end_kib - rss_start_kib) * 1024,
    }
    partial = out / f"rank{rank}.json.partial"  # the driver watches for the complete file
    partial.write_text(json.dumps(result))
    partial.rename(out / f"rank{rank}.json")
    faulthandler.dump_traceback_later(10, exit=False)  # tell where teardown hangs, if it does
    dist.barrier()  # tear down together: no rank destroys its group while a peer still uses it
    dist.destroy_process_group()


class _Clock:
    """Per-step wall times of the timed steps (each started together after a barrier), their
    CPU time, and every step's loss."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.step = 0
        self.times: list[float] = []
        self.losses: list[float] = []
        self.cpu_s = self.wall_s = 0.0
        self.proc_stat: dict[str, int] = {}
        self._start = self._cpu0 = self._wall0 = 0.0
        self._stat0: dict[str, int] = {}

    def start(self) -> None:
        import torch.distributed as dist

        if self.step == self.warmup:
            self._cpu0, self._wall0 = time.process_time(), time.perf_counter()
            self._stat0 = _proc_stat()
        dist.barrier()  # start every step together: the time is the step's, not the skew's
        self._start = time.perf_counter()

    def stop(self, loss: float) -> None:
        elapsed = time.perf_counter() - self._start
        self.losses.append(loss)
        if self.step >= self.warmup:
            self.times.append(elapsed)
        if self.step == self.warmup + self.steps - 1:
            self.cpu_s = time.process_time() - self._cpu0
            self.wall_s = time.perf_counter() - self._wall0
            end = _proc_stat()
            self.proc_stat = {k: end[k] - self._stat0.get(k, 0) for k in end}
        self.step += 1


def _lightning(x: Any, y: Any, clock: _Clock) -> None:
    """The row through Trainer(strategy=ZeroPPStrategy), timed by a callback."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zeropp import ZeroPPStrategy
    from lightning_zeropp.models import GPTConfig
    from lightning_zeropp.models.lit_gpt import LitGPT

    class Timer(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            clock.start()

        def on_train_batch_end(
            self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int
        ) -> None:
            clock.stop(float(outputs["loss"]))

    total = clock.warmup + clock.steps
    # Each rank loads its data-parallel slice itself (the sampler Lightning would inject
    # shuffles): rows [dp_rank * B/dp, ...) of the same global batch at every step, as the
    # Accelerate row's loader gives it. Ranks are pp-major, so dp_rank = rank % dp.
    dp_rank = int(os.environ["RANK"]) % DP
    rows = slice(dp_rank * GLOBAL_BATCH // DP, (dp_rank + 1) * GLOBAL_BATCH // DP)
    data = TensorDataset(x[rows].repeat(total, 1), y[rows].repeat(total, 1))
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // DP, shuffle=False, drop_last=True)
    micro = GLOBAL_BATCH // DP // LAYOUT["num_microbatches"]
    torch.manual_seed(0)  # the same initial weights in both rows
    module = LitGPT(GPTConfig(**MODEL), micro_batch_size=micro, optimizer="adamw", lr=LR)
    strategy = ZeroPPStrategy(split="stack", timeout=PG_TIMEOUT, **LAYOUT)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=total,
        gradient_clip_val=CLIP,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Timer()],
    )
    trainer.fit(module, loader)


def _accelerate(x: Any, y: Any, clock: _Clock) -> None:
    """The row through prepare_pipeline in a plain Accelerate loop."""
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zeropp.accelerate import prepare_pipeline
    from lightning_zeropp.core import ZeroPPConfig
    from lightning_zeropp.models import GPT, GPTConfig

    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(split_batches=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=PG_TIMEOUT)],
    )
    total = clock.warmup + clock.steps
    torch.manual_seed(0)  # the same initial weights in both rows
    model = GPT(GPTConfig(**MODEL))
    # The Lightning row's optimizer: LitGPT's AdamW (eps 1e-6, weight decay 0.1).
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6, weight_decay=0.1)
    data = TensorDataset(x.repeat(total, 1), y.repeat(total, 1))
    train_dl = DataLoader(data, batch_size=GLOBAL_BATCH, shuffle=False, drop_last=True)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    engine, optimizer, train_dl, _ = prepare_pipeline(
        accelerator,
        model,
        optimizer,
        train_dl,
        loss_fn=loss_fn,
        config=ZeroPPConfig(**LAYOUT),
        split="stack",
    )
    del model
    for batch in train_dl:
        clock.start()
        loss = engine.step(batch)
        engine.clip_grad_norm_(CLIP)
        optimizer.step()
        optimizer.zero_grad()
        clock.stop(float(loss))


def _core(x: Any, y: Any, clock: _Clock) -> None:
    """The same training with the core engine alone: what both fronts add their overhead to."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
    from lightning_zeropp.models import GPT, GPTConfig

    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    torch.manual_seed(0)  # the same initial weights in every row
    model = GPT(GPTConfig(**MODEL))

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    engine = ZeroPPEngine(model, ZeroPPConfig(**LAYOUT), loss_fn=loss_fn, split="stack")
    del model
    optimizer = torch.optim.AdamW(engine.parameters(), lr=LR, eps=1e-6, weight_decay=0.1)
    rows = slice(
        engine.dims.dp_rank * GLOBAL_BATCH // DP, (engine.dims.dp_rank + 1) * GLOBAL_BATCH // DP
    )
    for _ in range(clock.warmup + clock.steps):
        clock.start()
        loss = engine.train_step(x[rows], target=y[rows])
        engine.clip_grad_norm_(CLIP)
        optimizer.step()
        optimizer.zero_grad()
        clock.stop(float(loss))


# ---------------------------------------------------------------------------------------- driver
def launch_row(row: str, steps: int, warmup: int) -> list[dict[str, Any]]:
    """Run one row on WORLD fresh processes; fail loudly (with log tails) on error or timeout."""
    args = ["--steps", str(steps), "--warmup", str(warmup)]
    return launch_ranks(__file__, row, WORLD, args, row_timeout_s(steps, warmup))


def machine() -> dict[str, Any]:
    import accelerate
    import lightning

    return {
        **common_machine(),
        "lightning": lightning.__version__,
        "accelerate": accelerate.__version__,
    }


def summarize(row: str, run: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    step_times = ranks[0]["step_times_s"]  # already the max over ranks, step by step
    # The ranks' CPU time over the timed steps per core-second of wall time: near 1 when they had
    # the cores to themselves, lower when other work on the machine took a share.
    cpu_share = sum(r["timed_cpu_s"] for r in ranks) / (
        max(r["timed_wall_s"] for r in ranks) * (os.cpu_count() or 1)
    )
    stat = ranks[0]["timed_proc_stat"]  # machine-wide: any rank's view will do
    total = sum(stat.values())
    # CPU time of other processes on this machine (other users' work shares its kernel) over the
    # timed steps, per core-second: the machine's busy time minus this row's ranks' own.
    busy_s = (total - stat.get("idle", 0) - stat.get("iowait", 0)) / os.sysconf("SC_CLK_TCK")
    wall = max(r["timed_wall_s"] for r in ranks) * (os.cpu_count() or 1)
    others = max(0.0, busy_s - sum(r["timed_cpu_s"] for r in ranks)) / wall
    return {
        "row": row,
        "run": run,
        "title": ROWS[row],
        "cpu_share": cpu_share,
        "steal_share": stat.get("steal", 0) / total if total else float("nan"),
        "others_share": others,
        "median_step_s": statistics.median(step_times),
        "step_times_s": step_times,
        "final_loss": ranks[0]["losses"][-1],
        "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
        "peak_rss_growth_bytes_per_rank": [r["peak_rss_growth_bytes"] for r in ranks],
        "ranks": ranks,
    }


def write_markdown(meta: dict[str, Any], runs: list[dict[str, Any]], path: Path) -> None:
    m = meta["machine"]
    fronts = list(dict.fromkeys(r["row"] for r in runs))
    lines = [
        "# Fronts: Lightning vs Accelerate (and no front), same pipeline",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, shared with other work (1-minute load "
        f"average {m['load_average_1m_at_start']:.1f} at the start); {WORLD} gloo ranks, "
        "OMP_NUM_THREADS=1 each",
        f"- Date: {m['date']}; torch {m['torch']}, lightning {m['lightning']}, accelerate "
        f"{m['accelerate']}; Python {m['python']}; commit {m['commit']}",
        f"- Model: GPT {meta['model']}, fp32; global batch {GLOBAL_BATCH} sequences (the same "
        f"every step); layout {meta['layout']} (split='stack'); AdamW lr {LR}, clipping at "
        f"{CLIP} by the global norm",
        f"- {meta['warmup']} warm-up steps, then {meta['steps']} timed steps (each: the pipeline's "
        "forward and backward, clipping, the AdamW step; data loading excluded); each front run "
        f"{meta['repeats']} times, alternating",
        "",
        "| Front | Median step (s), median over runs | Runs' medians (s) |",
        "|---|---:|---|",
    ]
    for front in fronts:
        medians = [r["median_step_s"] for r in runs if r["row"] == front]
        lines.append(
            f"| {ROWS[front]} | {statistics.median(medians):.2f} | "
            + ", ".join(f"{t:.2f}" for t in medians)
            + " |"
        )
    lines += [
        "",
        "Every run: step time is the median (and range) over the timed steps of the slowest "
        "rank's time (ranks start each step together after a barrier). CPU share: the ranks' CPU "
        "time over the timed steps per core-second of wall time (near 1: the ranks had the cores "
        "to themselves). Others: CPU time of other processes on the machine over the same "
        "window, per core-second (/proc/stat busy time minus the ranks' own). Steal: the share "
        "of the machine's CPU time the hypervisor gave to other guests (/proc/stat). Runs with "
        "CPU share well below 1, or others or steal well above 0, were slowed by other work. "
        "Even so, the machine's speed drifts by tens of percent between runs with none of these "
        "showing it, hence the alternating repeats. Peak RSS: `ru_maxrss` "
        "of each rank process (resource.getrusage) at the end, and its growth from just after "
        "`import torch` (so it counts the front's imports, its process group, the model and "
        "training), ranks 0 / 1 / 2 / 3.",
        "",
        "| Run | Front | Median step (s) | Min-max (s) | CPU share | Others | Steal | "
        "Peak RSS per rank (MiB) | Peak RSS growth per rank (MiB) | Final loss |",
        "|---:|---|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for r in runs:
        t = r["step_times_s"]
        peak = " / ".join(f"{b / MIB:.0f}" for b in r["peak_rss_bytes_per_rank"])
        growth = " / ".join(f"{b / MIB:.0f}" for b in r["peak_rss_growth_bytes_per_rank"])
        lines.append(
            f"| {r['run']} | {r['row']} | {r['median_step_s']:.2f} | {min(t):.2f}-{max(t):.2f} | "
            f"{r['cpu_share']:.2f} | {r['others_share']:.2f} | {r['steal_share']:.2f} | "
            f"{peak} | {growth} | "
            f"{r['final_loss']:.4f} |"
        )
    lines += [
        "",
        "The final losses agree when both fronts train the same thing. Peak RSS includes each "
        "front's imports (the Accelerate rank imports Lightning too: `lightning_zeropp` imports "
        "its strategy) and the whole model, built on every rank before it is split; it is a "
        "high-water mark, not what a rank holds in steady state.",
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of rows")
    parser.add_argument("--repeats", type=int, default=3, help="runs per front, alternating")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_rank(args.worker, args.steps, args.warmup, Path(args.out))
        return
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1 and --warmup at least 0")
    names = [r for r in args.rows.split(",") if r]
    unknown = set(names) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from {list(ROWS)}")
    meta_machine = machine()
    start = time.monotonic()
    runs = []
    for run in range(1, args.repeats + 1):
        for name in names if run % 2 else names[::-1]:  # ABC CBA ...: no row always goes first
            t0 = time.monotonic()
            runs.append(summarize(name, run, launch_row(name, args.steps, args.warmup)))
            print(
                f"run {run} {name}: median step {runs[-1]['median_step_s']:.2f}s, CPU share "
                f"{runs[-1]['cpu_share']:.2f}, others {runs[-1]['others_share']:.2f}, steal "
                f"{runs[-1]['steal_share']:.2f} "
                f"({time.monotonic() - t0:.0f}s)"
            )
    meta = {
        "machine": meta_machine,
        "model": MODEL,
        "layout": LAYOUT,
        "global_batch": GLOBAL_BATCH,
        "world_size": WORLD,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "wall_s": round(time.monotonic() - start, 1),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_markdown(meta, runs, RESULTS / "fronts.md")
    (RESULTS / "fronts.json").write_text(json.dumps({**meta, "runs": runs}, indent=1) + "\n")
    print((RESULTS / "fronts.md").read_text())


if __name__ == "__main__":
    main()
