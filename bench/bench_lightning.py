"""The Lightning front's cost: ZeroPPStrategy against Lightning's own DDP and FSDP strategies.

    python bench/bench_lightning.py [--steps 6] [--warmup 2] [--repeats 2] [--rows ddp,fsdp,...]
        [--profile-rows zeropp_pp1,zeropp_pp2,fsdp] [--profile-steps 2] [--out-name lightning]

Every row trains the bundled `LitGPT` (same GPT, same initial weights, same global batch, AdamW,
no clipping) through `pl.Trainer(strategy=...)` on the same 4 CPU gloo ranks, in its own 4 fresh
processes launched by this script, `--repeats` times, alternating the order. Per row: setup time
(Trainer construction and `fit` until the first training batch starts, with its phases), step
time (median over the timed steps of the slowest rank), the whole fit's wall time, peak RSS per
rank. The FSDP row is Lightning's ModelParallelStrategy with FSDP2 applied in `configure_model`
(as ZeroPP shards a stage): Lightning's `strategy="fsdp"` (FSDPStrategy) refuses the CPU
accelerator ("requires a GPU accelerator"). Then a profile pass (cProfile on rank 0 and on the
last rank, over `--profile-steps` steps after the warm-up) of each `--profile-rows` row says where
a step's time goes (`BENCH_PSTATS_DIR=dir` keeps the raw .pstats files). `--model tiny` trains a
smaller GPT, on which fixed per-step costs dominate.

Results go to bench/results/<out-name>.md and .json (default `lightning`; also `BENCH_OUT_NAME`),
overwritten. When bench/results/<baseline>.json exists (`--baseline`, default
`lightning_before`) and is another file, the Markdown sets this run's figures beside it.
"""

from __future__ import annotations

import time

WORKER_START = time.time()  # before any heavy import: the rank's import time starts here

import argparse  # noqa: E402
import cProfile  # noqa: E402
import datetime  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from lightning_profile import profile_summary  # noqa: E402
from lightning_report import markdown  # noqa: E402

WORLD = 4
MODELS = {  # --model: "small" (default, compute dominates a step) or "tiny" (overheads do)
    "small": {"vocab_size": 256, "seq_len": 128, "dim": 256, "num_heads": 4, "num_layers": 8},
    "tiny": {"vocab_size": 256, "seq_len": 64, "dim": 128, "num_heads": 4, "num_layers": 8},
}
GLOBAL_BATCH = 32
LR = 1e-3
ROWS: dict[str, dict[str, Any]] = {
    "ddp": {"title": "Lightning `strategy='ddp'` (DDPStrategy), dp 4", "dp": 4},
    "fsdp": {
        "title": "Lightning ModelParallelStrategy (FSDP2: `fully_shard` per Block + root in "
        "`configure_model`), dp_shard 4",
        "dp": 4,
    },
    "zeropp_pp1": {
        "title": "ZeroPPStrategy(pp_size=1, dp_shard_size=4)",
        "dp": 4,
        "layout": {"pp_size": 1, "dp_shard_size": 4},
    },
    "zeropp_pp2": {
        "title": "ZeroPPStrategy(pp_size=2, dp_shard_size=2, schedule='1f1b', num_microbatches=4)",
        "dp": 2,
        "layout": {"pp_size": 2, "dp_shard_size": 2, "schedule": "1f1b", "num_microbatches": 4},
    },
    "zeropp_pp2_stack": {
        "title": "As `zeropp_pp2`, with `split='stack'` (no tracing: the user's forward, no fx "
        "interpreter)",
        "dp": 2,
        "layout": {"pp_size": 2, "dp_shard_size": 2, "schedule": "1f1b", "num_microbatches": 4},
        "split": "stack",
    },
    "zeropp_sched": {
        "title": "ZeroPPStrategy(pp_size=2, dp_shard_size=2, schedule='zeropp', "
        "num_microbatches=8): the recipe's `parallel=zeropp` (2 chunks per rank, U = 2, split "
        "backward)",
        "dp": 2,
        "layout": {"pp_size": 2, "dp_shard_size": 2, "schedule": "zeropp", "num_microbatches": 8},
    },
}
DEFAULT_ROWS = "ddp,fsdp,zeropp_pp1,zeropp_pp2"
PHASES = {  # callback hook -> what ended just before it (relative to just before `pl.Trainer(`)
    "trainer_init": "`pl.Trainer(...)` constructed",
    "setup": "process group and mesh (strategy.setup_environment), at Callback.setup",
    "fit_start": "model wrapped / split / sharded, optimizer built (strategy.setup), at on_fit_start",
    "train_start": "at on_train_start",
    "first_batch": "first on_train_batch_start",
}
PG_TIMEOUT = datetime.timedelta(seconds=120)


def row_timeout_s(steps: int) -> float:
    """Start-up plus a generous 20 s a step (a step takes 1.5 to 3 s on 2 cores)."""
    return harness.row_timeout_s(steps, start_s=180.0, per_step_s=20.0)


# ---------------------------------------------------------------------------------------- rank
def run_rank(
    row: str, model: dict[str, int], steps: int, warmup: int, profile_steps: int, out: Path
) -> None:
    """One rank of one row: fit warm-up + timed (or profiled) steps, write this rank's JSON."""
    import torch

    total = warmup + (profile_steps or steps)
    rank = harness.start_rank(row_timeout_s(total))
    rss_start_kib = harness.max_rss_kib()
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_zeropp
    from lightning_zeropp.models import GPTConfig
    from lightning_zeropp.models.lit_gpt import LitGPT

    marks: dict[str, float] = {
        "process_start": harness.process_start(WORKER_START),
        "worker_start": WORKER_START,
    }
    marks["imported"] = time.time()
    # The global batch, the same at every step. Each rank loads its data-parallel slice itself
    # (no sampler: Lightning's would shuffle); ranks are pp-major, so dp_rank = rank % dp.
    dp = ROWS[row]["dp"]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(
        0, model["vocab_size"], (GLOBAL_BATCH, model["seq_len"] + 1), generator=gen
    )
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    rows = slice((rank % dp) * GLOBAL_BATCH // dp, (rank % dp + 1) * GLOBAL_BATCH // dp)
    data = TensorDataset(x[rows].repeat(total, 1), y[rows].repeat(total, 1))
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // dp, shuffle=False, drop_last=True)
    micro = GLOBAL_BATCH // dp // ROWS[row].get("layout", {}).get("num_microbatches", 1)
    torch.manual_seed(0)  # the same initial weights in every row
    module = _module_class(row, LitGPT)(
        GPTConfig(**model), micro_batch_size=micro, optimizer="adamw", lr=LR
    )
    profiled = bool(profile_steps) and rank in (0, WORLD - 1)
    clock = harness.StepClock(
        warmup,
        profile_steps or steps,
        profiler=cProfile.Profile() if profiled else None,
        reduce_loss=_global_mean,
    )

    class Timer(pl.Callback):
        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            marks["setup"] = time.time()

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            marks["fit_start"] = time.time()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            marks["train_start"] = time.time()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, i: int) -> None:
            marks.setdefault("first_batch", time.time())
            clock.start()

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int
        ) -> None:
            clock.stop(float(outputs["loss"]))

    marks["before_trainer"] = time.time()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=_strategy(row),
        max_steps=total,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Timer()],
    )
    marks["trainer_init"] = time.time()
    trainer.fit(module, loader)
    marks["fit_end"] = time.time()
    result = {
        "rank": rank,
        "library": lightning_zeropp.__file__,
        "marks": marks,
        **clock.result(),
        "step_cpu_s": clock.cpu_times,
        **harness.rss_figures(rss_start_kib),
        "profile": profile_summary(clock.profiler, len(clock.times)) if profiled else None,
    }
    if profiled and os.environ.get("BENCH_PSTATS_DIR"):  # raw profiles, for pstats / snakeviz
        dump = Path(os.environ["BENCH_PSTATS_DIR"]) / f"{row}_rank{rank}.pstats"
        dump.parent.mkdir(parents=True, exist_ok=True)
        clock.profiler.dump_stats(dump)
    harness.finish_rank(out, rank, result)


def _global_mean(loss: float) -> float:
    """The global batch's loss: DDP and FSDP return this rank's own, ZeroPP the global mean on
    every rank; the mean over ranks is the global mean for both (equal slices)."""
    import torch
    import torch.distributed as dist

    total = torch.tensor(loss, dtype=torch.float64)
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _module_class(row: str, lit_gpt: type) -> type:
    """LitGPT itself, or (fsdp row) LitGPT with the `configure_model` ModelParallelStrategy needs:
    FSDP2 exactly as ZeroPP shards a stage (`core.shard.fsdp.shard_stage`), one unit per Block + root."""
    if row != "fsdp":
        return lit_gpt

    class LitGPTFSDP(lit_gpt):  # type: ignore[misc,valid-type]
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    return LitGPTFSDP


def _strategy(row: str) -> Any:
    if row == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(timeout=PG_TIMEOUT)
    if row == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(
            data_parallel_size=WORLD, tensor_parallel_size=1, timeout=PG_TIMEOUT
        )
    from lightning_zeropp import ZeroPPStrategy

    split = ROWS[row].get("split", "trace")  # the strategy's default: trace
    return ZeroPPStrategy(timeout=PG_TIMEOUT, split=split, **ROWS[row]["layout"])


# ---------------------------------------------------------------------------------------- driver
def launch_row(
    row: str, model: str, steps: int, warmup: int, profile_steps: int = 0
) -> list[dict[str, Any]]:
    """Run one row on WORLD fresh processes; fail loudly (with log tails) on error or timeout."""
    timeout = row_timeout_s(warmup + (profile_steps or steps))
    options = {"model": model, "steps": steps, "warmup": warmup, "profile_steps": profile_steps}
    return harness.launch(__file__, row, WORLD, timeout, **options)


def summarize(row: str, run: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    per_step = harness.slowest_per_step(r["step_times_s"] for r in ranks)
    # CPU seconds a step costs, summed over the ranks: the work, less sensitive than wall time to
    # other processes sharing the cores (gloo blocks rather than spins while a rank waits).
    cpu_per_step = harness.summed_per_step(r["step_cpu_s"] for r in ranks)

    def phase(end: str, start: str = "before_trainer") -> float:  # slowest rank
        return max(r["marks"][end] - r["marks"][start] for r in ranks)

    return {
        "row": row,
        "run": run,
        "title": ROWS[row]["title"],
        "library": sorted({r["library"] for r in ranks}),
        "setup_s": phase("first_batch"),
        "setup_phases_s": {p: phase(p) for p in PHASES},
        "import_s": phase("imported", "process_start"),
        "process_to_first_batch_s": phase("first_batch", "process_start"),
        "fit_wall_s": phase("fit_end"),
        "median_step_s": statistics.median(per_step),
        "median_step_cpu_s": statistics.median(cpu_per_step),
        "step_cpu_s": cpu_per_step,
        "step_times_s": per_step,
        **harness.load_shares(ranks),
        "final_loss": ranks[0]["losses"][-1],
        "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
        "ranks": [{k: v for k, v in r.items() if k != "profile"} for r in ranks],
        "profiles": {r["rank"]: r["profile"] for r in ranks if r["profile"]},
    }


def main() -> None:
    parser = harness.arg_parser(__doc__, steps=6, warmup=2, repeats=2, rows=DEFAULT_ROWS)
    parser.add_argument(
        "--profile-rows",
        default="zeropp_pp1,zeropp_pp2,fsdp",
        help="rows to profile after the timed runs ('' for none)",
    )
    parser.add_argument("--profile-steps", type=int, default=2, help="profiled steps per row")
    parser.add_argument(
        "--out-name",
        default=os.environ.get("BENCH_OUT_NAME", "lightning"),
        help="results file stem in bench/results (default: $BENCH_OUT_NAME or 'lightning')",
    )
    parser.add_argument(
        "--baseline",
        default="lightning_before",
        help="results stem to compare with, when that file exists ('' for none)",
    )
    parser.add_argument("--model", choices=list(MODELS), default="small", help="GPT size")
    parser.add_argument(
        "--render", action="store_true", help="only rewrite <out-name>.md from <out-name>.json"
    )
    args = parser.parse_args()
    if args.worker:
        model = MODELS[args.model]
        run_rank(args.worker, model, args.steps, args.warmup, args.profile_steps, Path(args.out))
        return
    if args.steps < 1 or args.warmup < 0 or args.repeats < 0 or args.profile_steps < 1:
        parser.error("--steps, --profile-steps at least 1; --warmup, --repeats at least 0")
    if args.render:
        data = harness.read_results(args.out_name)
        runs, profiles = data.pop("runs"), data.pop("profiles")
        lines = markdown(data, runs, profiles, _baseline(args), phases=PHASES, lr=LR)
        print(harness.write_results(args.out_name, lines).read_text())
        return
    names = harness.pick_rows(parser, args.rows, ROWS)
    profile_names = harness.pick_rows(parser, args.profile_rows, ROWS)
    meta_machine = harness.machine("lightning", library_only=True)
    start = time.monotonic()
    runs = harness.run_rows(
        names,
        args.repeats,
        lambda name, run: summarize(
            name, run, launch_row(name, args.model, args.steps, args.warmup)
        ),
        lambda r: (
            f"setup {r['setup_s']:.1f}s, median step {r['median_step_s']:.2f}s, fit "
            f"{r['fit_wall_s']:.1f}s, CPU share {r['cpu_share']:.2f}, others "
            f"{r['others_share']:.2f}, steal {r['steal_share']:.2f}"
        ),
    )
    profiles = []
    for name in profile_names:
        t0 = time.monotonic()
        ranks = launch_row(name, args.model, args.steps, args.warmup, args.profile_steps)
        profiles.append(_profile(name, summarize(name, 0, ranks), args))
        print(f"profile {name}: done ({time.monotonic() - t0:.0f}s)", flush=True)
    meta = {
        "out_name": args.out_name,
        "machine": meta_machine,
        "library": ", ".join(sorted({lib for r in runs for lib in r["library"]})),
        "model_name": args.model,
        "model": MODELS[args.model],
        "global_batch": GLOBAL_BATCH,
        "world_size": WORLD,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "wall_s": round(time.monotonic() - start, 1),
    }
    lines = markdown(meta, runs, profiles, _baseline(args), phases=PHASES, lr=LR)
    data = {**meta, "runs": runs, "profiles": profiles}
    print(harness.write_results(args.out_name, lines, data).read_text())


def _profile(name: str, s: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One profiled run: the profiled ranks' summaries and their mean step."""
    return {
        "row": name,
        "steps": args.profile_steps,
        "warmup": args.warmup,
        "median_step_s": s["median_step_s"],
        "step_s_by_rank": {
            r["rank"]: statistics.mean(r["step_times_s"])
            for r in s["ranks"]
            if r["rank"] in s["profiles"]
        },
        "profiles": s["profiles"],
        "cpu_share": s["cpu_share"],
    }


def _baseline(args: argparse.Namespace) -> dict[str, Any] | None:
    path = harness.RESULTS / f"{args.baseline}.json"
    if args.baseline and args.baseline != args.out_name and path.exists():
        return harness.read_results(args.baseline)
    return None


if __name__ == "__main__":
    main()
