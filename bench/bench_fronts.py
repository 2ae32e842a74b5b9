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

import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import MIB  # noqa: E402

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


def row_timeout_s(steps: int, warmup: int) -> float:
    """Start-up plus a generous 20 s a step (a step takes about 2 s on 2 cores)."""
    return harness.row_timeout_s(warmup + steps, start_s=150.0, per_step_s=20.0)


# ---------------------------------------------------------------------------------------- rank
def run_rank(row: str, steps: int, warmup: int, out: Path) -> None:
    """One rank of one row: train warm-up + timed steps and write this rank's JSON."""
    import torch

    rank = harness.start_rank(row_timeout_s(steps, warmup))
    # The global batch, the same at every step (as in bench_layouts.py).
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(
        0, MODEL["vocab_size"], (GLOBAL_BATCH, MODEL["seq_len"] + 1), generator=gen
    )
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    # Before the front's imports, its process group and the model: growth from here is the row's.
    rss_start_kib = harness.max_rss_kib()
    clock = harness.StepClock(warmup, steps)
    {"lightning": _lightning, "accelerate": _accelerate, "core": _core}[row](x, y, clock)
    result = {
        "rank": rank,
        **clock.result(),
        # a step takes as long as its slowest rank
        "step_times_s": harness.slowest(clock.times),
        **harness.rss_figures(rss_start_kib),
    }
    harness.finish_rank(out, rank, result)


def _lightning(x: Any, y: Any, clock: harness.StepClock) -> None:
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


def _accelerate(x: Any, y: Any, clock: harness.StepClock) -> None:
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


def _core(x: Any, y: Any, clock: harness.StepClock) -> None:
    """The same training with the core engine alone: what both fronts add their overhead to."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_zeropp import launch_layout
    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
    from lightning_zeropp.models import GPT, GPTConfig

    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    torch.manual_seed(0)  # the same initial weights in every row
    model = GPT(GPTConfig(**MODEL))

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    engine = ZeroPPEngine(
        model, launch_layout(ZeroPPConfig(**LAYOUT)), loss_fn=loss_fn, split="stack"
    )
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
def summarize(row: str, run: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    step_times = ranks[0]["step_times_s"]  # already the max over ranks, step by step
    return {
        "row": row,
        "run": run,
        "title": ROWS[row],
        **harness.load_shares(ranks),
        "median_step_s": statistics.median(step_times),
        "step_times_s": step_times,
        "final_loss": ranks[0]["losses"][-1],
        "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
        "peak_rss_growth_bytes_per_rank": [r["peak_rss_growth_bytes"] for r in ranks],
        "ranks": ranks,
    }


def markdown(meta: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    fronts = list(dict.fromkeys(r["row"] for r in runs))
    lines = [
        "# Fronts: Lightning vs Accelerate (and no front), same pipeline",
        "",
        *harness.machine_lines(meta["machine"], WORLD, ("lightning", "accelerate")),
        f"- Model: GPT {meta['model']}, fp32; global batch {GLOBAL_BATCH} sequences (the same "
        f"every step); layout {meta['layout']} (split='stack'); AdamW lr {LR}, clipping at "
        f"{CLIP} by the global norm",
        f"- {meta['warmup']} warm-up steps, then {meta['steps']} timed steps (each: the pipeline's "
        "forward and backward, clipping, the AdamW step; data loading excluded); each front run "
        f"{meta['repeats']} times, alternating",
        "",
    ]
    medians = {f: [r["median_step_s"] for r in runs if r["row"] == f] for f in fronts}
    lines += harness.table(
        ["Front", "Median step (s), median over runs", "Runs' medians (s)"],
        "lrl",
        (
            [ROWS[f], f"{statistics.median(m):.2f}", ", ".join(f"{t:.2f}" for t in m)]
            for f, m in medians.items()
        ),
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
    ]
    lines += harness.table(
        ["Run", "Front", "Median step (s)", "Min-max (s)", "CPU share", "Others", "Steal"]
        + ["Peak RSS per rank (MiB)", "Peak RSS growth per rank (MiB)", "Final loss"],
        "rlrrrrrllr",
        (
            [
                r["run"],
                r["row"],
                f"{r['median_step_s']:.2f}",
                f"{min(r['step_times_s']):.2f}-{max(r['step_times_s']):.2f}",
                *(f"{r[k]:.2f}" for k in ("cpu_share", "others_share", "steal_share")),
                " / ".join(f"{b / MIB:.0f}" for b in r["peak_rss_bytes_per_rank"]),
                " / ".join(f"{b / MIB:.0f}" for b in r["peak_rss_growth_bytes_per_rank"]),
                f"{r['final_loss']:.4f}",
            ]
            for r in runs
        ),
    )
    lines += [
        "",
        "The final losses agree when both fronts train the same thing. Peak RSS includes each "
        "front's imports (the Accelerate rank imports Lightning too: `lightning_zeropp` imports "
        "its strategy) and the whole model, built on every rank before it is split; it is a "
        "high-water mark, not what a rank holds in steady state.",
    ]
    return lines


def main() -> None:
    parser = harness.arg_parser(__doc__, steps=6, warmup=2, repeats=3, rows=",".join(ROWS))
    args = parser.parse_args()
    if args.worker:
        run_rank(args.worker, args.steps, args.warmup, Path(args.out))
        return
    harness.check_counts(parser, args)
    names = harness.pick_rows(parser, args.rows, ROWS)
    meta_machine = harness.machine("lightning", "accelerate")
    start = time.monotonic()

    def one_run(name: str, run: int) -> dict[str, Any]:
        timeout = row_timeout_s(args.steps, args.warmup)
        ranks = harness.launch(__file__, name, WORLD, timeout, steps=args.steps, warmup=args.warmup)
        return summarize(name, run, ranks)

    runs = harness.run_rows(
        names,
        args.repeats,
        one_run,
        lambda r: (
            f"median step {r['median_step_s']:.2f}s, CPU share {r['cpu_share']:.2f}, "
            f"others {r['others_share']:.2f}, steal {r['steal_share']:.2f}"
        ),
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
    md = harness.write_results("fronts", markdown(meta, runs), {**meta, "runs": runs})
    print(md.read_text())


if __name__ == "__main__":
    main()
