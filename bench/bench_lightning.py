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
import faulthandler  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch_ranks  # noqa: E402
from common import machine as common_machine  # noqa: E402
from common import proc_stat as _proc_stat  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
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
MIB = 2**20


def row_timeout_s(steps: int) -> float:
    """Start-up plus a generous 20 s a step (a step takes 1.5 to 3 s on 2 cores)."""
    return 180.0 + 20.0 * steps


# ---------------------------------------------------------------------------------------- rank
def run_rank(
    row: str, model: dict[str, int], steps: int, warmup: int, profile_steps: int, out: Path
) -> None:
    """One rank of one row: fit warm-up + timed (or profiled) steps, write this rank's JSON."""
    import torch

    total = warmup + (profile_steps or steps)
    faulthandler.dump_traceback_later(row_timeout_s(total) - 15, exit=False)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    rss_start_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_zeropp
    from lightning_zeropp.models import GPTConfig
    from lightning_zeropp.models.lit_gpt import LitGPT

    marks: dict[str, float] = {"process_start": _process_start(), "worker_start": WORKER_START}
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
    clock = _Clock(warmup, profile_steps or steps, profiled)

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
    rss_end_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = {
        "rank": rank,
        "library": lightning_zeropp.__file__,
        "marks": marks,
        "step_times_s": clock.times,
        "step_cpu_s": clock.cpu_times,
        "losses": clock.losses,
        "timed_cpu_s": clock.cpu_s,
        "timed_proc_stat": clock.proc_stat,
        "timed_wall_s": clock.wall_s,
        "peak_rss_bytes": rss_end_kib * 1024,
        "peak_rss_growth_bytes": (rss_end_kib - rss_start_kib) * 1024,
        "profile": profile_summary(clock.profiler, len(clock.times)) if profiled else None,
    }
    if profiled and os.environ.get("BENCH_PSTATS_DIR"):  # raw profiles, for pstats / snakeviz
        dump = Path(os.environ["BENCH_PSTATS_DIR"]) / f"{row}_rank{rank}.pstats"
        dump.parent.mkdir(parents=True, exist_ok=True)
        clock.profiler.dump_stats(dump)  # type: ignore[union-attr]
    partial = out / f"rank{rank}.json.partial"  # the driver watches for the complete file
    partial.write_text(json.dumps(result))
    partial.rename(out / f"rank{rank}.json")
    faulthandler.dump_traceback_later(10, exit=False)  # tell where teardown hangs, if it does
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # tear down together: no rank destroys its group while a peer still uses it
        dist.destroy_process_group()


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


def _process_start() -> float:
    """This process's start (epoch seconds, 10 ms resolution) from /proc: before Python itself."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, IndexError, ValueError):
        return WORKER_START


class _Clock:
    """Per-step wall times of the timed steps (each started together after a barrier), their CPU
    time and the machine's /proc/stat over them, every step's loss; optionally cProfile them."""

    def __init__(self, warmup: int, steps: int, profiled: bool) -> None:
        self.warmup, self.steps = warmup, steps
        self.step = 0
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # this process's CPU time in each timed step
        self.losses: list[float] = []
        self.cpu_s = self.wall_s = 0.0
        self.proc_stat: dict[str, int] = {}
        self.profiler = cProfile.Profile() if profiled else None
        self._start = self._cpu_start = self._cpu0 = self._wall0 = 0.0
        self._stat0: dict[str, int] = {}

    def _timed(self) -> bool:
        return self.warmup <= self.step < self.warmup + self.steps

    def start(self) -> None:
        import torch.distributed as dist

        if self.step == self.warmup:
            self._cpu0, self._wall0 = time.process_time(), time.perf_counter()
            self._stat0 = _proc_stat()
        dist.barrier()  # start every step together: the time is the step's, not the skew's
        if self.profiler is not None and self._timed():
            self.profiler.enable()
        self._start, self._cpu_start = time.perf_counter(), time.process_time()

    def stop(self, loss: float) -> None:
        import torch
        import torch.distributed as dist

        elapsed = time.perf_counter() - self._start
        cpu = time.process_time() - self._cpu_start
        if self.profiler is not None and self._timed():
            self.profiler.disable()
        # The global batch's loss: DDP and FSDP return this rank's own, ZeroPP the global mean
        # on every rank; the mean over ranks is the global mean for both (equal slices).
        total = torch.tensor(loss, dtype=torch.float64)
        dist.all_reduce(total)
        self.losses.append(float(total) / dist.get_world_size())
        if self._timed():
            self.times.append(elapsed)
            self.cpu_times.append(cpu)
        if self.step == self.warmup + self.steps - 1:
            self.cpu_s = time.process_time() - self._cpu0
            self.wall_s = time.perf_counter() - self._wall0
            end = _proc_stat()
            self.proc_stat = {k: end[k] - self._stat0.get(k, 0) for k in end}
        self.step += 1


# ------------------------------------------------------------------------------------- profile
# (label, file path suffix or "~" for built-ins, function names, "ct" cumulative or "tt" own time).
# Indentation in the label is nesting (each line includes the indented lines under it).
PROFILE_ITEMS: list[tuple[str, str, tuple[str, ...], str]] = [
    ("optimizer.step (Lightning's closure: training_step + backward inside)", "torch/optim/adam.py", ("step",), "ct"),
    ("  Lightning `_AutomaticOptimization._training_step`", "loops/optimization/automatic.py", ("_training_step",), "ct"),
    ("    strategy.training_step: ZeroPPStrategy", "lightning_zeropp/lightning/strategy.py", ("training_step",), "ct"),
    ("    strategy.training_step: Lightning's (DDP / FSDP)", "lightning/pytorch/strategies/", ("training_step",), "ct"),
    ("      ZeroPP: capture (user step up to the network call, whole batch)", "lightning_zeropp/lightning/", ("_capture_inputs", "capture"), "ct"),
    ("      ZeroPP: engine.train_step", "lightning_zeropp/core/engine.py", ("train_step",), "ct"),
    ("        pipeline schedule .step (torch.distributed.pipelining)", "torch/distributed/pipelining/schedules.py", ("step",), "ct"),
    ("          stage forward_one_chunk", "torch/distributed/pipelining/stage.py", ("forward_one_chunk",), "ct"),
    ("          stage backward_one_chunk", "torch/distributed/pipelining/stage.py", ("backward_one_chunk",), "ct"),
    ("          stage backward_weight_one_chunk (split backward's weight gradients)", "torch/distributed/pipelining/stage.py", ("backward_weight_one_chunk",), "ct"),
    ("          fx Interpreter.run (traced stages run node by node; with their ops)", "torch/fx/interpreter.py", ("run",), "ct"),
    ("          waiting for p2p (_wait_batch_p2p)", "torch/distributed/pipelining/schedules.py", ("_wait_batch_p2p",), "ct"),
    ("          waiting for FSDP all-gathers in the runtime (_assert_unsharded)", "torch/distributed/pipelining/schedules.py", ("_assert_unsharded",), "ct"),
    ("          stage perform_reduce_grad (gradient reduce-scatter, end of step)", "torch/distributed/pipelining/stage.py", ("perform_reduce_grad",), "ct"),
    ("          ZeroPP: scheduled loss (the user's training_step, per micro-batch)", "lightning_zeropp/lightning/", ("_scheduled_loss", "scheduled_loss"), "ct"),
    ("          ZeroPP: call-split stage forward (the model's own forward, stubs)", "lightning_zeropp/core/split/call_stages.py", ("run",), "ct"),
    ("        ZeroPP: _broadcast_loss", "lightning_zeropp/core/engine.py", ("_broadcast_loss",), "ct"),
    ("      ZeroPP: LogRecorder.replay (log values to every stage)", "lightning_zeropp/lightning/logging.py", ("replay",), "ct"),
    ("        broadcast_object_list", "torch/distributed/distributed_c10d.py", ("broadcast_object_list",), "ct"),
    ("      ZeroPP: StepGrads take + apply", "lightning_zeropp/core/step/grads.py", ("__init__", "apply"), "ct"),
    ("    LitGPT.training_step (all calls)", "lightning_zeropp/models/lit_gpt.py", ("training_step",), "ct"),
    ("      LightningModule.log (Lightning's, sync_dist all-reduce inside)", "lightning/pytorch/core/module.py", ("log",), "ct"),
    ("  backward: autograd engine (run_backward, with FSDP / DDP hooks; ZeroPP: inside the schedule)", "~", ("<method 'run_backward' of 'torch._C._EngineBase' objects>",), "ct"),
    ("  AdamW math (torch.optim.adam.adam)", "torch/optim/adam.py", ("adam",), "ct"),
    ("  optimizer.zero_grad", "torch/optim/optimizer.py", ("zero_grad",), "ct"),
    ("waiting on collectives / p2p (c10d wait, own time)", "~", ("<built-in method torch._C._distributed_c10d.wait>", "<method 'wait' of 'torch._C._distributed_c10d.Work' objects>"), "tt"),
    ("dist.barrier (own + wait)", "torch/distributed/distributed_c10d.py", ("barrier",), "ct"),
    ("dist.broadcast / all_reduce (Python entry)", "torch/distributed/distributed_c10d.py", ("broadcast", "all_reduce"), "ct"),
]  # fmt: skip


def profile_summary(prof: cProfile.Profile | str | Path | None, steps: int) -> dict[str, Any]:
    """Per-step seconds of the PROFILE_ITEMS and the top functions by cumulative and own time
    (from a profiler or a saved .pstats file)."""
    assert prof is not None
    if isinstance(prof, Path):
        prof = str(prof)
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    items = []
    for label, suffix, names, kind in PROFILE_ITEMS:
        total, calls = 0.0, 0
        for (path, _line, func), (_cc, nc, tt, ct, _callers) in stats.items():
            hit = path == "~" if suffix == "~" else path.replace("\\", "/").find(suffix) >= 0
            if hit and func in names:
                total += ct if kind == "ct" else tt
                calls += nc
        items.append({"label": label, "s_per_step": total / steps, "calls_per_step": calls / steps})

    def name(key: tuple[str, int, str]) -> str:
        path, line, func = key
        if path == "~":
            return func
        for marker in ("site-packages/", "/lightning_zeropp/", "/bench/"):
            if marker in path:
                path = path.split(marker, 1)[1]
                if marker == "/lightning_zeropp/":
                    path = "lightning_zeropp/" + path
                break
        return f"{path}:{line}({func})"

    def top(index: int, n: int = 25) -> list[dict[str, Any]]:
        ranked = sorted(stats.items(), key=lambda kv: kv[1][index], reverse=True)[:n]
        return [
            {
                "function": name(k),
                "calls_per_step": v[1] / steps,
                "own_s_per_step": v[2] / steps,
                "cum_s_per_step": v[3] / steps,
            }
            for k, v in ranked
        ]

    return {"steps": steps, "items": items, "top_cumulative": top(3), "top_own": top(2)}


# ---------------------------------------------------------------------------------------- driver
def launch_row(
    row: str, model: str, steps: int, warmup: int, profile_steps: int = 0
) -> list[dict[str, Any]]:
    """Run one row on WORLD fresh processes; fail loudly (with log tails) on error or timeout."""
    args = ["--model", model, "--steps", str(steps), "--warmup", str(warmup)]
    args += ["--profile-steps", str(profile_steps)]
    return launch_ranks(
        __file__, row, WORLD, args, row_timeout_s(warmup + (profile_steps or steps))
    )


def machine() -> dict[str, Any]:
    """common.machine(), with the commit marked dirty only for changes outside bench/ (the
    library's code, which is what is measured)."""
    import subprocess

    import lightning

    info = {**common_machine(), "lightning": lightning.__version__}
    commit = info["commit"].split(" ", 1)[0]
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", ".", ":(exclude)bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    info["commit"] = commit + (" (uncommitted changes outside bench/)" if dirty else "")
    return info


def summarize(row: str, run: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    per_step = [max(ts) for ts in zip(*(r["step_times_s"] for r in ranks), strict=True)]
    # CPU seconds a step costs, summed over the ranks: the work, less sensitive than wall time to
    # other processes sharing the cores (gloo blocks rather than spins while a rank waits).
    cpu_per_step = [sum(ts) for ts in zip(*(r["step_cpu_s"] for r in ranks), strict=True)]
    cores = os.cpu_count() or 1
    wall = max(r["timed_wall_s"] for r in ranks) * cores
    cpu_share = sum(r["timed_cpu_s"] for r in ranks) / wall
    stat = ranks[0]["timed_proc_stat"]  # machine-wide: any rank's view will do
    total = sum(stat.values())
    busy_s = (total - stat.get("idle", 0) - stat.get("iowait", 0)) / os.sysconf("SC_CLK_TCK")
    others = max(0.0, busy_s - sum(r["timed_cpu_s"] for r in ranks)) / wall

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
        "cpu_share": cpu_share,
        "others_share": others,
        "steal_share": stat.get("steal", 0) / total if total else float("nan"),
        "final_loss": ranks[0]["losses"][-1],
        "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
        "ranks": [{k: v for k, v in r.items() if k != "profile"} for r in ranks],
        "profiles": {r["rank"]: r["profile"] for r in ranks if r["profile"]},
    }


def _med(runs: list[dict[str, Any]], row: str, key: str) -> float:
    return statistics.median(r[key] for r in runs if r["row"] == row)


def write_markdown(
    meta: dict[str, Any],
    runs: list[dict[str, Any]],
    profiles: list[dict[str, Any]],
    baseline: dict[str, Any] | None,
    path: Path,
) -> None:
    m = meta["machine"]
    rows = list(dict.fromkeys(r["row"] for r in runs))
    ref = "fsdp" if "fsdp" in rows else None
    lines = [
        "# The Lightning front's cost: ZeroPPStrategy vs Lightning's DDP and FSDP",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, shared with other work (1-minute load "
        f"average {m['load_average_1m_at_start']:.1f} at the start); {WORLD} gloo ranks, "
        "OMP_NUM_THREADS=1 each",
        f"- Date: {m['date']}; torch {m['torch']}, lightning {m['lightning']}; Python "
        f"{m['python']}; commit {m['commit']}; library measured: {meta['library']}",
        f"- Model: `LitGPT(GPTConfig({', '.join(f'{k}={v}' for k, v in meta['model'].items())}))`, fp32; "
        f"global batch {GLOBAL_BATCH} sequences (the same every step), split over the "
        f"data-parallel ranks; AdamW lr {LR}; no clipping; `logger=False`, no progress bar, no "
        "checkpointing, no validation; `train_loss` logged with `sync_dist=True` (LitGPT's own)",
        f"- {meta['warmup']} warm-up steps, then {meta['steps']} timed steps; runs per row: "
        f"{meta['repeats']}, each in 4 fresh processes, rows alternating their order; whole "
        f"script {meta['wall_s']:.0f} s",
        "",
        "| Row | Layout |",
        "|---|---|",
        *(f"| `{r}` | {ROWS[r]['title']} |" for r in rows),
        "",
        "## Summary (median over runs)",
        "",
        "Setup: from just before `pl.Trainer(...)` to the first `on_train_batch_start` (Trainer "
        "construction, process group, wrapping / splitting / sharding, optimizer, loop start), "
        "slowest rank. Step: per step the slowest rank's time from `on_train_batch_start` (after a "
        "barrier) to `on_train_batch_end` (forward, backward, optimizer step, Lightning's "
        "bookkeeping; data loading excluded), median over the timed steps. Fit: `pl.Trainer(...)` "
        "to `fit` returning (all steps, with the per-step barriers), slowest rank. Process start to "
        "first batch adds Python start-up and imports. Step CPU: the CPU seconds of one step "
        "summed over the 4 ranks (median over the timed steps): the step's work, which other "
        "processes on the machine disturb far less than its wall time (a waiting gloo rank "
        "sleeps); on a machine shared with other work, compare rows by it. Fastest step: the "
        "least step time of any run, the least disturbed one.",
        "",
        "| Row | Setup (s) | Median step (s) | Step / "
        + (f"`{ref}`" if ref else "-")
        + " | Step / `ddp` | Fastest step (s) | Step CPU (s) | Step CPU / "
        + (f"`{ref}`" if ref else "-")
        + " | Fit wall (s) | Fit / `ddp` | Process start to first batch (s) | "
        "Peak RSS, max rank (MiB) | Final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        step = _med(runs, row, "median_step_s")
        fit = _med(runs, row, "fit_wall_s")
        vs_ref = f"{step / _med(runs, ref, 'median_step_s'):.2f}" if ref else "-"
        cpu = _med(runs, row, "median_step_cpu_s")
        fastest = min(min(r["step_times_s"]) for r in runs if r["row"] == row)
        cpu_ref = f"{cpu / _med(runs, ref, 'median_step_cpu_s'):.2f}" if ref else "-"
        vs_ddp = f"{step / _med(runs, 'ddp', 'median_step_s'):.2f}" if "ddp" in rows else "-"
        fit_ddp = f"{fit / _med(runs, 'ddp', 'fit_wall_s'):.2f}" if "ddp" in rows else "-"
        rss = statistics.median(max(r["peak_rss_bytes_per_rank"]) for r in runs if r["row"] == row)
        loss = next(r["final_loss"] for r in runs if r["row"] == row)
        lines.append(
            f"| `{row}` | {_med(runs, row, 'setup_s'):.1f} | {step:.2f} | {vs_ref} | {vs_ddp} | "
            f"{fastest:.2f} | {cpu:.2f} | {cpu_ref} | {fit:.1f} | {fit_ddp} | {_med(runs, row, 'process_to_first_batch_s'):.1f} | "
            f"{rss / MIB:.0f} | {loss:.4f} |"
        )
    if baseline is not None:
        lines += _baseline_table(baseline, runs, rows)
    lines += [
        "",
        "## Setup phases (median over runs; seconds since just before `pl.Trainer(...)`, slowest "
        "rank at each mark)",
        "",
        "| Row | " + " | ".join(PHASES) + " |",
        "|---|" + "---:|" * len(PHASES),
    ]
    for row in rows:
        cells = [
            statistics.median(r["setup_phases_s"][p] for r in runs if r["row"] == row)
            for p in PHASES
        ]
        lines.append(f"| `{row}` | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    lines += ["", *(f"- `{p}`: {d}" for p, d in PHASES.items())]
    lines += [
        "",
        "## Every run",
        "",
        "CPU share: the ranks' CPU time over the timed steps per core-second of wall time (near 1: "
        "the ranks had the cores to themselves). Others: CPU time of other processes on the "
        "machine over the same window, per core-second (/proc/stat busy time minus the ranks' "
        "own). Steal: the share of the machine's CPU time the hypervisor gave to other guests. "
        "Runs with CPU share well below 1, or others or steal well above 0, were slowed by other "
        "work. Peak RSS: `ru_maxrss` of each rank at the end (imports, the whole model built on "
        "every rank before wrapping, training), ranks 0 / 1 / 2 / 3.",
        "",
        "| Run | Row | Setup (s) | Median step (s) | Min-max (s) | Step CPU (s) | Fit wall (s) | "
        "CPU share | Others | Steal | Peak RSS per rank (MiB) | Final loss |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in runs:
        t = r["step_times_s"]
        peak = " / ".join(f"{b / MIB:.0f}" for b in r["peak_rss_bytes_per_rank"])
        lines.append(
            f"| {r['run']} | `{r['row']}` | {r['setup_s']:.1f} | {r['median_step_s']:.2f} | "
            f"{min(t):.2f}-{max(t):.2f} | {r['median_step_cpu_s']:.2f} | {r['fit_wall_s']:.1f} | {r['cpu_share']:.2f} | "
            f"{r['others_share']:.2f} | {r['steal_share']:.2f} | {peak} | {r['final_loss']:.4f} |"
        )
    for p in profiles:
        lines += _profile_section(p)
    path.write_text("\n".join(lines) + "\n")


def _baseline_table(
    baseline: dict[str, Any], runs: list[dict[str, Any]], rows: list[str]
) -> list[str]:
    """This run beside an earlier one; the ratios to `fsdp` within each run are the figures that
    survive a slower or busier machine best."""
    before = baseline["runs"]
    bm = baseline["machine"]
    lines = [
        "",
        f"## Against `{baseline['out_name']}` (commit {bm['commit']}, {bm['date']})",
        "",
        "| Row | Setup before / now (s) | Step before / now (s) | Step / `fsdp` before / now | "
        "Step CPU before / now (s) | Step CPU / `fsdp` before / now | Fit before / now (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def ratio(rs: list[dict[str, Any]], row: str, key: str) -> str:
        if not any(r["row"] == "fsdp" for r in rs) or not any(key in r for r in rs):
            return "-"
        return f"{_med(rs, row, key) / _med(rs, 'fsdp', key):.2f}"

    def pair(row: str, key: str, fmt: str) -> str:
        return " / ".join(
            format(_med(rs, row, key), fmt) if all(key in r for r in rs) else "-"
            for rs in (before, runs)
        )

    for row in rows:
        if not any(r["row"] == row for r in before):
            continue
        lines.append(
            f"| `{row}` | {pair(row, 'setup_s', '.1f')} | {pair(row, 'median_step_s', '.2f')} | "
            f"{ratio(before, row, 'median_step_s')} / {ratio(runs, row, 'median_step_s')} | "
            f"{pair(row, 'median_step_cpu_s', '.2f')} | "
            f"{ratio(before, row, 'median_step_cpu_s')} / {ratio(runs, row, 'median_step_cpu_s')} | "
            f"{pair(row, 'fit_wall_s', '.1f')} |"
        )
    return lines


def _profile_section(p: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"## Profile: `{p['row']}` (cProfile, {p['steps']} steps after {p['warmup']} warm-up; "
        f"profiled median step {p['median_step_s']:.2f} s, unprofiled ranks alongside)",
        "",
        "Seconds per step (cumulative time of the function and everything it calls, unless marked "
        "own); indentation is nesting (under ZeroPP the backward runs inside the schedule, under "
        "DDP / FSDP in Lightning's closure). cProfile slows Python-heavy code more than C++ kernels, so Python overheads are "
        "overstated relative to compute. Ranks 0 and "
        f"{WORLD - 1} (for `zeropp_pp2`: the first and the last pipeline stage).",
        "",
        "| What | " + " | ".join(f"rank {k} s/step (calls)" for k in p["profiles"]) + " |",
        "|---|" + "---:|" * len(p["profiles"]),
        "| step (on_train_batch_start to end, mean) | "
        + " | ".join(f"{s:.3f}" for s in p["step_s_by_rank"].values())
        + " |",
        "| &nbsp;&nbsp;outside optimizer.step (Lightning's loop, hooks, results; derived) | "
        + " | ".join(
            f"{p['step_s_by_rank'][k] - prof['items'][0]['s_per_step']:.3f}"
            for k, prof in p["profiles"].items()
        )
        + " |",
    ]
    labels = [i["label"] for i in next(iter(p["profiles"].values()))["items"]]
    for idx, label in enumerate(labels):
        cells = [prof["items"][idx] for prof in p["profiles"].values()]
        if all(c["calls_per_step"] == 0 for c in cells):
            continue
        shown = label.lstrip(" ")
        indent = "&nbsp;" * 2 * (len(label) - len(shown))
        lines.append(
            f"| {indent}{shown} | "
            + " | ".join(f"{c['s_per_step']:.3f} ({c['calls_per_step']:g})" for c in cells)
            + " |"
        )
    for rank, prof in p["profiles"].items():
        lines += [
            "",
            f"Rank {rank}, top 15 by cumulative time (s per step; calls per step):",
            "",
            "| Function | Cumulative | Own | Calls |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| `{e['function']}` | {e['cum_s_per_step']:.3f} | {e['own_s_per_step']:.3f} | "
            f"{e['calls_per_step']:g} |"
            for e in prof["top_cumulative"][:15]
        ]
        lines += [
            "",
            f"Rank {rank}, top 12 by own time:",
            "",
            "| Function | Own | Cumulative | Calls |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| `{e['function']}` | {e['own_s_per_step']:.3f} | {e['cum_s_per_step']:.3f} | "
            f"{e['calls_per_step']:g} |"
            for e in prof["top_own"][:12]
        ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--repeats", type=int, default=2, help="runs per row, alternating")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help=f"of {list(ROWS)}")
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
        "--render",
        action="store_true",
        help="only rewrite <out-name>.md from <out-name>.json (no runs)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_rank(
            args.worker,
            MODELS[args.model],
            args.steps,
            args.warmup,
            args.profile_steps,
            Path(args.out),
        )
        return
    if args.steps < 1 or args.warmup < 0 or args.repeats < 0 or args.profile_steps < 1:
        parser.error("--steps, --profile-steps at least 1; --warmup, --repeats at least 0")
    if args.render:
        data = json.loads((RESULTS / f"{args.out_name}.json").read_text())
        runs, profiles = data.pop("runs"), data.pop("profiles")
        write_markdown(data, runs, profiles, _baseline(args), RESULTS / f"{args.out_name}.md")
        print((RESULTS / f"{args.out_name}.md").read_text())
        return
    names = [r for r in args.rows.split(",") if r]
    profile_names = [r for r in args.profile_rows.split(",") if r]
    unknown = set(names + profile_names) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from {list(ROWS)}")
    meta_machine = machine()
    start = time.monotonic()
    runs = []
    for run in range(1, args.repeats + 1):
        for name in names if run % 2 else names[::-1]:  # ABCD DCBA ...: no row always goes first
            t0 = time.monotonic()
            runs.append(summarize(name, run, launch_row(name, args.model, args.steps, args.warmup)))
            r = runs[-1]
            print(
                f"run {run} {name}: setup {r['setup_s']:.1f}s, median step "
                f"{r['median_step_s']:.2f}s, fit {r['fit_wall_s']:.1f}s, CPU share "
                f"{r['cpu_share']:.2f}, others {r['others_share']:.2f}, steal "
                f"{r['steal_share']:.2f} ({time.monotonic() - t0:.0f}s)",
                flush=True,
            )
    profiles = []
    for name in profile_names:
        t0 = time.monotonic()
        s = summarize(
            name, 0, launch_row(name, args.model, args.steps, args.warmup, args.profile_steps)
        )
        profiles.append(
            {
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
        )
        print(f"profile {name}: done ({time.monotonic() - t0:.0f}s)", flush=True)
    libraries = sorted({lib for r in runs for lib in r["library"]})
    meta = {
        "out_name": args.out_name,
        "machine": meta_machine,
        "library": ", ".join(libraries),
        "model_name": args.model,
        "model": MODELS[args.model],
        "global_batch": GLOBAL_BATCH,
        "world_size": WORLD,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "wall_s": round(time.monotonic() - start, 1),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    md = RESULTS / f"{args.out_name}.md"
    write_markdown(meta, runs, profiles, _baseline(args), md)
    (RESULTS / f"{args.out_name}.json").write_text(
        json.dumps({**meta, "runs": runs, "profiles": profiles}, indent=1) + "\n"
    )
    print(md.read_text())


def _baseline(args: argparse.Namespace) -> dict[str, Any] | None:
    path = RESULTS / f"{args.baseline}.json"
    if args.baseline and args.baseline != args.out_name and path.exists():
        return json.loads(path.read_text())
    return None


if __name__ == "__main__":
    main()
