"""A run_clm-shaped HF loop under plain Accelerate DDP, `ZeroPPAccelerator` and `prepare_pipeline`.

    python bench/bench_accelerate.py [--steps 10] [--warmup 3] [--repeats 2]
        [--rows ddp,plugin,prepare_pipeline] [--microbatches 4] [--per-device-batch 4]
    python bench/bench_accelerate.py --render    # rewrite accelerate.md from accelerate.json

The same tiny HF Llama (`AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", ...))`,
same initial weights), the same global batch (per-device batch x 4 processes) of right-padded rows
with an attention mask and `-100` labels on the padding, AdamW over run_clm's decay / no-decay
groups, a cosine `get_scheduler`, clipping at 1.0, on 4 gloo CPU ranks (one thread each), in three
rows:

- `ddp`: `Accelerator(cpu=True)` + `accelerator.prepare(model, optimizer, loader, scheduler)` (DDP
  over 4 processes); the loop `outputs = model(**batch); accelerator.backward(outputs.loss);
  accelerator.clip_grad_norm_(...); optimizer.step(); scheduler.step(); optimizer.zero_grad()`
  under `accelerator.accumulate(model)`.
- `plugin`: `ZeroPPAccelerator(zeropp_plugin=ZeroPPPlugin(pp_size=2, num_microbatches=M),
  cpu=True)`, everything else identical (the loader's batch size is per process, as under DDP:
  each data-parallel rank reads pp_size batches).
- `prepare_pipeline`: `prepare_pipeline(accelerator, model, opt, loader, sched, loss_fn=...,
  config=ZeroPPConfig(pp_size=2, num_microbatches=M))` in a plain Accelerate loop
  (`engine.step(batch)`, `engine.clip_grad_norm_`); its loader's batch size is per data-parallel
  rank, so it gets per-device batch x pp_size rows.

Per rank: setup (`prepare`), every step's time (from just after a barrier, around the whole loop
iteration: fetching the batch through the end of `zero_grad`) split by loop line, plus the
pipeline's `core.train_step` and (plugin row) the token-count all-reduces inside `model(**batch)`,
timed by wrappers this script sets on the prepared objects; CPU time, peak RSS. Each row runs in 4
fresh processes launched by this script, `--repeats` times, alternating the order. Results go to
bench/results/accelerate.md and .json (overwritten; `BENCH_RESULTS=dir` writes them elsewhere).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import functools
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
PP = 2
SEQ = 64
LLAMA = {  # AutoConfig.for_model("llama", **LLAMA)
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": SEQ,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    # No KV cache in training: ZeroPPAccelerator turns it off itself, prepare_pipeline refuses a
    # last stage that returns a DynamicCache; off in every row so that all compute the same.
    "use_cache": False,
}
LR, WEIGHT_DECAY, CLIP = 1e-3, 0.1, 1.0
ROWS = {
    "ddp": "Plain Accelerate DDP: `Accelerator(cpu=True)` + `accelerator.prepare(...)`, dp 4",
    "plugin": "`ZeroPPAccelerator(zeropp_plugin=ZeroPPPlugin(pp_size=2, num_microbatches=M), "
    "cpu=True)`, the identical loop (pp 2 x dp_shard 2, 1F1B over FSDP2)",
    "prepare_pipeline": "`prepare_pipeline(accelerator, model, opt, dl, sched, loss_fn=..., "
    "config=ZeroPPConfig(pp_size=2, num_microbatches=M))`, `engine.step(batch)` loop",
}
# Per loop line, in order: what each step's time splits into. "forward" is `model(**batch)` (the
# whole pipeline step under ZeroPP) or `engine.step(batch)`; "backward" `accelerator.backward`
# (under ZeroPP: the hand-off of the step's gradients to .grad); nothing for prepare_pipeline.
PHASES = ("data", "forward", "backward", "clip", "optimizer", "scheduler", "zero_grad")
INNER = ("train_step", "token_count")  # timed by wrappers, inside "forward"
PG_TIMEOUT = datetime.timedelta(seconds=120)
MIB = 2**20


def row_timeout_s(steps: int) -> float:
    """Start-up plus a generous 15 s a step (a step takes well under 1 s on 2 quiet cores)."""
    return 240.0 + 15.0 * steps


# ---------------------------------------------------------------------------------------- rank
def run_rank(row: str, opts: argparse.Namespace, out: Path) -> None:
    """One rank of one row: the loop's warm-up + timed steps; write this rank's JSON."""
    import torch

    total = opts.warmup + opts.steps
    faulthandler.dump_traceback_later(row_timeout_s(total) - 15, exit=False)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    rss_start_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    marks = {"start": time.perf_counter()}
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    import lightning_zeropp
    from lightning_zeropp.accelerate import (
        ZeroPPAccelerator,
        ZeroPPPlugin,
        prepare_pipeline,
    )
    from lightning_zeropp.core import ZeroPPConfig

    marks["imported"] = time.perf_counter()
    handlers = [InitProcessGroupKwargs(timeout=PG_TIMEOUT)]
    if row == "plugin":
        plugin = ZeroPPPlugin(pp_size=PP, num_microbatches=opts.microbatches)
        accelerator: Any = ZeroPPAccelerator(
            zeropp_plugin=plugin, cpu=True, kwargs_handlers=handlers
        )
    else:
        accelerator = Accelerator(cpu=True, kwargs_handlers=handlers)
    marks["accelerator"] = time.perf_counter()
    model = build_model()
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR)
    # Batch size per process (DDP, plugin) or per data-parallel rank (prepare_pipeline): the same
    # global batch, per-device batch x 4 rows, in every row.
    batch_size = opts.per_device_batch * (PP if row == "prepare_pipeline" else 1)
    rows = opts.per_device_batch * WORLD * total
    loader = DataLoader(
        PaddedTexts(rows, seed=1), batch_size=batch_size, shuffle=False, collate_fn=collate
    )
    scheduler = get_scheduler(  # run_clm's sizing, in per-process scheduler steps
        "cosine",
        optimizer=optimizer,
        num_warmup_steps=2 * accelerator.num_processes,
        num_training_steps=total * accelerator.num_processes,
    )
    marks["objects"] = time.perf_counter()
    clock = _Clock(opts.warmup, opts.steps)
    if row == "prepare_pipeline":
        engine, optimizer, loader, scheduler = prepare_pipeline(
            accelerator,
            model,
            optimizer,
            loader,
            scheduler,
            loss_fn=lambda output, labels: output.loss,  # the model's own (labels passed to it)
            config=ZeroPPConfig(pp_size=PP, num_microbatches=opts.microbatches),
            unpack=lambda b: ((), dict(b), b["labels"]),
        )
        del model
        marks["prepared"] = time.perf_counter()
        clock.wrap(engine.core, "train_step", "train_step")
        info = {"dims": _dims(engine.dims), "split": "auto"}
        loop_pipeline(accelerator, engine, optimizer, loader, scheduler, clock)
    else:
        model, optimizer, loader, scheduler = accelerator.prepare(
            model, optimizer, loader, scheduler
        )
        marks["prepared"] = time.perf_counter()
        info = {"model_class": type(model).__name__}
        if row == "plugin":
            clock.wrap(model.engine.core, "train_step", "train_step")
            clock.wrap(model, "_weighted", "token_count")
            info["dims"] = _dims(model.engine.dims)
        loop_accelerate(accelerator, model, optimizer, loader, scheduler, clock)
    if len(clock.records) != total:
        raise RuntimeError(f"the loader gave {len(clock.records)} batches, not {total}")
    losses = torch.tensor(clock.losses, dtype=torch.float64)
    dist.all_reduce(losses)  # DDP: each process's own loss; ZeroPP: the global one on every rank
    rss_end_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = {
        "rank": rank,
        "library": lightning_zeropp.__file__,
        "info": info,
        "marks_s": {k: v - marks["start"] for k, v in marks.items()},
        "setup_s": marks["prepared"] - marks["objects"],
        "steps": clock.records[opts.warmup :],
        "warmup_steps": clock.records[: opts.warmup],
        "losses": (losses / dist.get_world_size()).tolist(),
        "timed_cpu_s": clock.cpu_s,
        "timed_wall_s": clock.wall_s,
        "timed_proc_stat": clock.proc_stat,
        "peak_rss_bytes": rss_end_kib * 1024,
        "peak_rss_growth_bytes": (rss_end_kib - rss_start_kib) * 1024,
    }
    partial = out / f"rank{rank}.json.partial"  # the driver watches for the complete file
    partial.write_text(json.dumps(result))
    partial.rename(out / f"rank{rank}.json")
    faulthandler.dump_traceback_later(10, exit=False)  # tell where teardown hangs, if it does
    dist.barrier()  # tear down together: no rank destroys its group while a peer still uses it
    dist.destroy_process_group()


def build_model() -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **LLAMA)
    torch.manual_seed(0)  # the same initial weights in every row
    return AutoModelForCausalLM.from_config(config)


def param_groups(model: Any) -> list[dict[str, Any]]:
    """run_clm's two AdamW groups: weight decay except on biases and norms."""
    no_decay = ("bias", "norm.weight", "layernorm.weight")
    named = list(model.named_parameters())
    return [
        {
            "params": [p for n, p in named if not any(k in n for k in no_decay)],
            "weight_decay": WEIGHT_DECAY,
        },
        {"params": [p for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]


class PaddedTexts:
    """Token rows of 3/4 SEQ to SEQ tokens, padded to SEQ on the right (`padding="max_length"`:
    every batch has one shape), as a tokenized corpus."""

    def __init__(self, rows: int, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(SEQ * 3 // 4, SEQ + 1, (rows,), generator=g)
        vocab = LLAMA["vocab_size"]
        self.rows = [torch.randint(1, vocab, (int(n),), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.rows[i]}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """input_ids, attention_mask, and labels with -100 on the padding (HF's collators)."""
    import torch

    ids = torch.zeros(len(samples), SEQ, dtype=torch.long)
    mask = torch.zeros(len(samples), SEQ, dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n], mask[row, :n] = s["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loop_accelerate(
    accelerator: Any, model: Any, optimizer: Any, loader: Any, scheduler: Any, clock: _Clock
) -> None:
    """run_clm's loop, line by line (the same for DDP and ZeroPPAccelerator)."""
    model.train()
    batches = iter(loader)
    while True:
        clock.start()
        batch = next(batches, None)
        if batch is None:
            return
        clock.lap("data")
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            clock.lap("forward")
            accelerator.backward(loss)
            clock.lap("backward")
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
            clock.lap("clip")
            optimizer.step()
            clock.lap("optimizer")
            scheduler.step()
            clock.lap("scheduler")
            optimizer.zero_grad()
            clock.lap("zero_grad")
        clock.stop(float(loss.detach()))


def loop_pipeline(
    accelerator: Any, engine: Any, optimizer: Any, loader: Any, scheduler: Any, clock: _Clock
) -> None:
    """The prepare_pipeline loop: engine.step runs forward and backward together."""
    batches = iter(loader)
    while True:
        clock.start()
        batch = next(batches, None)
        if batch is None:
            return
        clock.lap("data")
        with accelerator.accumulate():
            loss = engine.step(batch)
            clock.lap("forward")
            clock.lap("backward")  # nothing: the backward ran inside engine.step
            if accelerator.sync_gradients:
                engine.clip_grad_norm_(CLIP)
            clock.lap("clip")
            optimizer.step()
            clock.lap("optimizer")
            scheduler.step()
            clock.lap("scheduler")
            optimizer.zero_grad()
            clock.lap("zero_grad")
        clock.stop(float(loss))


def _dims(dims: Any) -> dict[str, int]:
    return {
        "pp_rank": dims.pp_rank,
        "pp_size": dims.config.pp_size,
        "dp_rank": dims.dp_rank,
        "dp_size": dims.dp_size,
    }


class _Clock:
    """Per step: the time of each loop line (laps after a barrier), the wrapped inner calls, the
    step's CPU time; over the timed steps: this process's CPU time, wall time and /proc/stat."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.records: list[dict[str, float]] = []
        self.losses: list[float] = []
        self.cpu_s = self.wall_s = 0.0
        self.proc_stat: dict[str, int] = {}
        self._inner: dict[str, float] = {}
        self._t = self._start = self._cpu = self._cpu0 = self._wall0 = 0.0
        self._laps: dict[str, float] = {}
        self._stat0: dict[str, int] = {}

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        """Time every call of `obj.attr` (an instance attribute shadowing the method: this
        process, these objects only) into the step's `name`."""
        inner = getattr(obj, attr)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._inner[name] = self._inner.get(name, 0.0) + time.perf_counter() - t0

        object.__setattr__(obj, attr, timed)

    def start(self) -> None:
        import torch.distributed as dist

        if len(self.records) == self.warmup:
            self._cpu0, self._wall0 = time.process_time(), time.perf_counter()
            self._stat0 = _proc_stat()
        dist.barrier()  # start every step together: the time is the step's, not the skew's
        self._laps, self._inner = {}, {}
        self._cpu = time.process_time()
        self._start = self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self._laps[name] = now - self._t
        self._t = now

    def stop(self, loss: float) -> None:
        record = {
            "total": time.perf_counter() - self._start,
            "cpu": time.process_time() - self._cpu,
            **self._laps,
            **{k: self._inner.get(k, 0.0) for k in INNER},
        }
        self.records.append(record)
        self.losses.append(loss)
        if len(self.records) == self.warmup + self.steps:
            self.cpu_s = time.process_time() - self._cpu0
            self.wall_s = time.perf_counter() - self._wall0
            end = _proc_stat()
            self.proc_stat = {k: end[k] - self._stat0.get(k, 0) for k in end}


# ---------------------------------------------------------------------------------------- driver
def launch_row(row: str, opts: argparse.Namespace) -> list[dict[str, Any]]:
    """Run one row on WORLD fresh processes; fail loudly (with log tails) on error or timeout."""
    args = ["--steps", str(opts.steps), "--warmup", str(opts.warmup)]
    args += ["--microbatches", str(opts.microbatches)]
    args += ["--per-device-batch", str(opts.per_device_batch)]
    return launch_ranks(__file__, row, WORLD, args, row_timeout_s(opts.warmup + opts.steps))


def machine() -> dict[str, Any]:
    import accelerate
    import transformers

    return {
        **common_machine(),
        "accelerate": accelerate.__version__,
        "transformers": transformers.__version__,
    }


def summarize(row: str, run: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One run of one row: slowest rank per step, CPU, the machine's other load, memory."""
    per_step = [
        max(s) for s in zip(*([x["total"] for x in r["steps"]] for r in ranks), strict=True)
    ]
    cpu_per_step = [
        sum(s) for s in zip(*([x["cpu"] for x in r["steps"]] for r in ranks), strict=True)
    ]
    cores = os.cpu_count() or 1
    wall = max(r["timed_wall_s"] for r in ranks) * cores
    ranks_cpu = sum(r["timed_cpu_s"] for r in ranks)
    stat = ranks[0]["timed_proc_stat"]  # machine-wide: any rank's view will do
    ticks = sum(stat.values())
    busy_s = (ticks - stat.get("idle", 0) - stat.get("iowait", 0)) / os.sysconf("SC_CLK_TCK")
    per_rank = []
    for r in ranks:
        steps = r["steps"]
        per_rank.append(
            {
                "rank": r["rank"],
                "dims": r["info"].get("dims"),
                "setup_s": r["setup_s"],
                "median_step_s": statistics.median(x["total"] for x in steps),
                "min_step_s": min(x["total"] for x in steps),
                "max_step_s": max(x["total"] for x in steps),
                "cpu_share": r["timed_cpu_s"] / r["timed_wall_s"],
                "phases_s": {
                    **{p: statistics.median(x.get(p, 0.0) for x in steps) for p in PHASES + INNER},
                    # derived per step, then the median (medians do not subtract)
                    "rest": statistics.median(
                        x["forward"] - x["train_step"] - x["token_count"] for x in steps
                    ),
                    "fwd_bwd": statistics.median(x["forward"] + x["backward"] for x in steps),
                },
                "peak_rss_bytes": r["peak_rss_bytes"],
                "peak_rss_growth_bytes": r["peak_rss_growth_bytes"],
            }
        )
    return {
        "row": row,
        "run": run,
        "title": ROWS[row],
        "library": sorted({r["library"] for r in ranks}),
        "info": ranks[0]["info"],
        "setup_s": max(r["setup_s"] for r in ranks),
        "accelerator_s": max(r["marks_s"]["accelerator"] - r["marks_s"]["imported"] for r in ranks),
        "median_step_s": statistics.median(per_step),
        "step_times_s": per_step,
        "median_step_cpu_s": statistics.median(cpu_per_step),
        "cpu_share": ranks_cpu / wall,
        "others_share": max(0.0, busy_s - ranks_cpu) / wall,
        "steal_share": stat.get("steal", 0) / ticks if ticks else float("nan"),
        "final_loss": ranks[0]["losses"][-1],
        "losses": ranks[0]["losses"],
        "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
        "per_rank": per_rank,
        "ranks": ranks,
    }


def _med(runs: list[dict[str, Any]], row: str, key: str) -> float:
    return statistics.median(r[key] for r in runs if r["row"] == row)


def _phase(
    runs: list[dict[str, Any]], row: str, phase: str, ranks: list[int] | None = None
) -> float:
    """Median over runs of the mean over ranks (or the given ranks) of each rank's median."""
    return statistics.median(
        statistics.mean(
            p["phases_s"][phase] for p in r["per_rank"] if ranks is None or p["rank"] in ranks
        )
        for r in runs
        if r["row"] == row
    )


def write_markdown(meta: dict[str, Any], runs: list[dict[str, Any]], path: Path) -> None:
    m = meta["machine"]
    rows = list(dict.fromkeys(r["row"] for r in runs))
    mb = meta["microbatches"]
    bubble = (PP - 1) / (mb + PP - 1)
    b = meta["per_device_batch"]
    lines = [
        "# A run_clm-shaped HF loop: plain Accelerate DDP vs ZeroPPAccelerator vs prepare_pipeline",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, shared with other work (1-minute load "
        f"average {m['load_average_1m_at_start']:.1f} at the start); {WORLD} gloo ranks, "
        "OMP_NUM_THREADS=1 and `torch.set_num_threads(1)` each",
        f"- Date: {m['date']}; torch {m['torch']}, accelerate {m['accelerate']}, transformers "
        f"{m['transformers']}; Python {m['python']}; commit {m['commit']}; library measured: "
        f"{meta['library']}",
        '- Model: `AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", '
        + ", ".join(f"{k}={v}" for k, v in LLAMA.items())
        + f"))`, {meta['params'] / 1e6:.2f} M parameters, fp32, the same initial weights in "
        "every row",
        f"- Data: rows of {SEQ * 3 // 4}-{SEQ} tokens right-padded to {SEQ} (`input_ids`, "
        "`attention_mask`, `labels` = -100 on the padding), in order (no shuffling); global "
        f"batch {b * WORLD} rows per step in every row: per-device batch {b} x {WORLD} processes "
        f"(`ddp`, `plugin`), {b * PP} rows per data-parallel rank x 2 (`prepare_pipeline`)",
        f"- Loop: AdamW lr {LR} over run_clm's decay / no-decay groups (weight decay "
        f"{WEIGHT_DECAY}), `get_scheduler('cosine')`, clipping at {CLIP}; pipelines: pp {PP} x "
        f"dp_shard 2, 1F1B over FSDP2, {mb} micro-batches, `split='auto'`",
        f"- {meta['warmup']} warm-up steps, then {meta['steps']} timed steps; runs per row: "
        f"{meta['repeats']}, each in {WORLD} fresh processes, rows alternating their order; whole "
        f"script {meta['wall_s']:.0f} s",
        "",
        "| Row | Layout |",
        "|---|---|",
        *(f"| `{r}` | {ROWS[r]} |" for r in rows),
        "",
        "## Summary (median over runs)",
        "",
        "Step: per step the slowest rank's time around the whole loop iteration (fetching the "
        "batch to the end of `zero_grad`; ranks start each step together after a barrier), median "
        "over the timed steps. Step CPU: the CPU seconds of one step summed over the 4 ranks "
        "(median over the steps): the work, which other processes on the machine disturb far "
        "less than the wall time (a waiting gloo rank mostly sleeps). Setup: `accelerator.prepare(...)` "
        "or `prepare_pipeline(...)`, slowest rank (the Accelerator's construction, with the "
        "process group, is the next column). CPU share: the ranks' CPU time over the timed steps "
        "per core-second of wall time (near 1: the 4 ranks had the 2 cores to themselves); "
        "others: other processes' CPU time on the machine over the same window, per core-second "
        "(/proc/stat busy time minus the ranks' own); steal: the hypervisor's share. Final loss: "
        "the last step's loss, averaged over ranks (DDP: the mean of the 4 processes' own "
        "token means; ZeroPP rows: the global token mean under the plugin, the mean of "
        "micro-batch token means under `prepare_pipeline`, so the rows agree to about 2 digits, "
        "not exactly).",
        "",
        "| Row | Setup (s) | Accelerator() (s) | Median step (s) | Step / `ddp` | Fastest step (s) "
        "| Step CPU (s) | Step CPU / `ddp` | CPU share | Others | Steal | Peak RSS, max rank "
        "(MiB) | Final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    has_ddp = "ddp" in rows
    for row in rows:
        step = _med(runs, row, "median_step_s")
        cpu = _med(runs, row, "median_step_cpu_s")
        vs = f"{step / _med(runs, 'ddp', 'median_step_s'):.2f}" if has_ddp else "-"
        cpu_vs = f"{cpu / _med(runs, 'ddp', 'median_step_cpu_s'):.2f}" if has_ddp else "-"
        fastest = min(min(r["step_times_s"]) for r in runs if r["row"] == row)
        rss = statistics.median(max(r["peak_rss_bytes_per_rank"]) for r in runs if r["row"] == row)
        loss = statistics.median(r["final_loss"] for r in runs if r["row"] == row)
        lines.append(
            f"| `{row}` | {_med(runs, row, 'setup_s'):.2f} | {_med(runs, row, 'accelerator_s'):.2f} "
            f"| {step:.3f} | {vs} | {fastest:.3f} | {cpu:.3f} | {cpu_vs} | "
            f"{_med(runs, row, 'cpu_share'):.2f} | {_med(runs, row, 'others_share'):.2f} | "
            f"{_med(runs, row, 'steal_share'):.2f} | {rss / MIB:.0f} | {loss:.4f} |"
        )
    lines += _breakdown(runs, rows, mb, bubble, b)
    lines += [
        "",
        "## Every run, per rank",
        "",
        "Per rank: setup (`prepare`), its own median step (and range) over the timed steps, its "
        "CPU share (its process's CPU time over the timed steps per second of wall time: 0.5 "
        "when 4 busy ranks share 2 cores evenly, lower for a rank that waits), peak RSS "
        "(`ru_maxrss` at the end: imports, the whole model built before wrapping or splitting, "
        "training) and its growth from the rank's start (after `import torch`). Ranks are "
        "pp-major: under ZeroPP ranks 0 and 1 hold the first stage, 2 and 3 the last.",
        "",
        "| Run | Row | Rank | pp / dp rank | Setup (s) | Median step (s) | Min-max (s) | CPU share "
        "| Peak RSS (MiB) | RSS growth (MiB) |",
        "|---:|---|---:|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in runs:
        for p in r["per_rank"]:
            d = p["dims"]
            where = f"{d['pp_rank']} / {d['dp_rank']}" if d else f"- / {p['rank']}"
            lines.append(
                f"| {r['run']} | `{r['row']}` | {p['rank']} | {where} | {p['setup_s']:.2f} | "
                f"{p['median_step_s']:.3f} | {p['min_step_s']:.3f}-{p['max_step_s']:.3f} | "
                f"{p['cpu_share']:.2f} | {p['peak_rss_bytes'] / MIB:.0f} | "
                f"{p['peak_rss_growth_bytes'] / MIB:.0f} |"
            )
    lines += [
        "",
        "Whole runs: CPU share / others / steal over the timed steps, and every timed step's "
        "slowest-rank time (s).",
        "",
        "| Run | Row | CPU share | Others | Steal | Steps (s) |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for r in runs:
        steps = ", ".join(f"{t:.3f}" for t in r["step_times_s"])
        lines.append(
            f"| {r['run']} | `{r['row']}` | {r['cpu_share']:.2f} | {r['others_share']:.2f} | "
            f"{r['steal_share']:.2f} | {steps} |"
        )
    path.write_text("\n".join(lines) + "\n")


def _breakdown(
    runs: list[dict[str, Any]], rows: list[str], mb: int, bubble: float, per_device: int
) -> list[str]:
    labels = {
        "data": "fetch the batch (`next(loader)`)",
        "forward": "`model(**batch)` / `engine.step(batch)`",
        "train_step": "&nbsp;&nbsp;of which the pipeline's `core.train_step`",
        "token_count": "&nbsp;&nbsp;of which the token-count all-reduces (`PipelineModel._weighted`)",
        "rest": "&nbsp;&nbsp;of which the rest (label checks, gradient swap, loss leaf)",
        "backward": "`accelerator.backward(loss)` (ZeroPP: the gradient hand-off)",
        "fwd_bwd": "forward + backward (DDP: the compute and gradient all-reduce; ZeroPP: the "
        "pipeline step)",
        "clip": "clip_grad_norm_",
        "optimizer": "`optimizer.step()`",
        "scheduler": "`scheduler.step()`",
        "zero_grad": "`optimizer.zero_grad()`",
        "sum": "sum of the lines",
    }
    stage_of = {}
    for r in runs:
        for p in r["per_rank"]:
            if p["dims"]:
                stage_of[p["rank"]] = p["dims"]["pp_rank"]
    first = sorted(k for k, s in stage_of.items() if s == 0)
    last = sorted(k for k, s in stage_of.items() if s == PP - 1)

    def cell(row: str, key: str, ranks: list[int] | None = None) -> float:
        if key == "sum":
            return sum(_phase(runs, row, p, ranks) for p in PHASES)
        return _phase(runs, row, key, ranks)

    # (header, row, ranks, subtract ddp's figure)
    cols: list[tuple[str, str, list[int] | None, bool]] = [
        (f"`{row}`", row, None, False) for row in rows
    ]
    if "ddp" in rows:
        cols += [(f"`{row}` - `ddp`", row, None, True) for row in rows if row != "ddp"]
    if "plugin" in rows and first and last:
        cols += [
            (f"`plugin`, first stage (ranks {', '.join(map(str, first))})", "plugin", first, False),
            (f"`plugin`, last stage (ranks {', '.join(map(str, last))})", "plugin", last, False),
        ]
    lines = [
        "",
        "## Where the time goes (ms per step)",
        "",
        "Each loop line's time, per rank the median over the timed steps, then the mean over the "
        "ranks (or over one pipeline stage's ranks), median over runs. The inner lines come from "
        "wrappers this script sets on the prepared objects (`engine.core.train_step`, "
        "`model._weighted`); lines are medians taken separately, so they need not add up to the "
        "median step exactly. The `- ddp` columns: the pipeline row's line minus DDP's (all "
        "ranks' mean): where the difference in step time goes.",
        "",
        "| Line | " + " | ".join(c[0] for c in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    keys = ["data", "forward", "train_step", "token_count", "rest", "backward", "fwd_bwd"]
    keys += ["clip", "optimizer", "scheduler", "zero_grad", "sum"]
    for key in keys:
        cells = []
        inner = key in ("train_step", "token_count", "rest")
        for _, row, ranks, diff in cols:
            if inner and (row == "ddp" or diff):
                cells.append("-")
            elif diff:
                cells.append(f"{1000 * (cell(row, key) - cell('ddp', key)):+.1f}")
            else:
                cells.append(f"{1000 * cell(row, key, ranks):.1f}")
        lines.append(f"| {labels[key]} | " + " | ".join(cells) + " |")
    last_work = _stage_work(last_stage=True)
    expect = last_work / (1 - bubble)
    lines += [
        "",
        f"Expectation for the pipeline rows: pp {PP} with M = {mb} micro-batches under 1F1B "
        f"leaves each stage idle for (pp-1)/(M+pp-1) = {PP - 1}/{mb + PP - 1} = {bubble:.0%} of "
        "the schedule, so with balanced stages and free communication a step takes "
        f"{1 / (1 - bubble):.2f}x one stage's compute. A pipeline rank runs half the decoder "
        "layers for twice a DDP rank's rows (the same layer work), plus the LM head and loss for "
        f"twice the rows on the last stage: its matmul work is {last_work:.2f}x a DDP rank's "
        f"(first stage: {_stage_work(last_stage=False):.2f}x), so with one core per rank (a "
        f"GPU-like setting) the pipelined forward + backward would take about {expect:.2f}x "
        "DDP's, before FSDP2's all-gathers and reduce-scatter over 2 ranks and the activations "
        "sent between the stages.",
    ]
    if "ddp" in rows:
        for row in (r for r in rows if r != "ddp"):
            fb = cell(row, "fwd_bwd") / cell("ddp", "fwd_bwd")
            step = _med(runs, row, "median_step_s") / _med(runs, "ddp", "median_step_s")
            cpu = _med(runs, row, "median_step_cpu_s") / _med(runs, "ddp", "median_step_cpu_s")
            lines.append(
                f"\nMeasured, `{row}` / `ddp`: forward + backward {fb:.2f}x, step {step:.2f}x, "
                f"step CPU {cpu:.2f}x."
            )
        lines.append(
            "\nBut here 4 ranks share 2 cores: while one rank idles in its bubble, another "
            "computes, so with the cores kept busy (CPU share near 1 in every row) wall time "
            "follows the ranks' total CPU time, and the bubble itself costs little. The step ratio "
            f"then measures extra work, not idling: matmuls over micro-batches of "
            f"{per_device * PP // mb} rows (DDP: {per_device}), FSDP2's gathers and "
            "reduce-scatter, the stage-to-stage sends, the "
            "schedule's Python, and any time gloo spends polling while it waits."
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--repeats", type=int, default=2, help="runs per row, alternating")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {list(ROWS)}")
    parser.add_argument("--microbatches", type=int, default=4, help="per pipeline step")
    parser.add_argument("--per-device-batch", type=int, default=4, help="rows per process")
    parser.add_argument(
        "--render", action="store_true", help="only rewrite accelerate.md from accelerate.json"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_rank(args.worker, args, Path(args.out))
        return
    if args.render:
        data = json.loads((RESULTS / "accelerate.json").read_text())
        runs = data.pop("runs")
        write_markdown(data, runs, RESULTS / "accelerate.md")
        print((RESULTS / "accelerate.md").read_text())
        return
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1 and --warmup at least 0")
    if (args.per_device_batch * PP) % args.microbatches:
        parser.error("per-device batch x pp (rows per data-parallel rank) must split into M")
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
            runs.append(summarize(name, run, launch_row(name, args)))
            r = runs[-1]
            print(
                f"run {run} {name}: setup {r['setup_s']:.2f}s, median step "
                f"{r['median_step_s']:.3f}s, step CPU {r['median_step_cpu_s']:.3f}s, CPU share "
                f"{r['cpu_share']:.2f}, others {r['others_share']:.2f}, steal "
                f"{r['steal_share']:.2f}, loss {r['final_loss']:.4f} "
                f"({time.monotonic() - t0:.0f}s)",
                flush=True,
            )
    meta = {
        "machine": meta_machine,
        "library": ", ".join(sorted({lib for r in runs for lib in r["library"]})),
        "model": LLAMA,
        "params": _param_count(),
        "seq_len": SEQ,
        "per_device_batch": args.per_device_batch,
        "global_batch": args.per_device_batch * WORLD,
        "microbatches": args.microbatches,
        "pp_size": PP,
        "world_size": WORLD,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "bubble_expected": (PP - 1) / (args.microbatches + PP - 1),
        "wall_s": round(time.monotonic() - start, 1),
    }
    if "ddp" in names:
        meta["ratios_to_ddp"] = {
            name: {
                "step": _med(runs, name, "median_step_s") / _med(runs, "ddp", "median_step_s"),
                "step_cpu": _med(runs, name, "median_step_cpu_s")
                / _med(runs, "ddp", "median_step_cpu_s"),
            }
            for name in names
        }
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_markdown(meta, runs, RESULTS / "accelerate.md")
    (RESULTS / "accelerate.json").write_text(json.dumps({**meta, "runs": runs}, indent=1) + "\n")
    print((RESULTS / "accelerate.md").read_text())


def _stage_work(last_stage: bool) -> float:
    """A pipeline rank's matmul work (weights x rows) over a DDP rank's: half the decoder layers
    and twice the rows, the LM head on the last stage (the embedding is a lookup)."""
    h, ffn, vocab = LLAMA["hidden_size"], LLAMA["intermediate_size"], LLAMA["vocab_size"]
    kv = h * LLAMA["num_key_value_heads"] // LLAMA["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * ffn
    layers = LLAMA["num_hidden_layers"]
    ddp = layers * layer + h * vocab
    stage = layers // PP * layer + (h * vocab if last_stage else 0)
    return PP * stage / ddp


def _param_count() -> int:
    return sum(p.numel() for p in build_model().parameters())


if __name__ == "__main__":
    main()
