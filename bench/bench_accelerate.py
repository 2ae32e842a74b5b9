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
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from accelerate_loop import (  # noqa: E402
    INNER,
    LLAMA,
    LR,
    PHASES,
    PP,
    SEQ,
    PaddedTexts,
    build_model,
    collate,
    loop_accelerate,
    loop_pipeline,
    param_count,
    param_groups,
)
from accelerate_report import markdown  # noqa: E402

WORLD = 4
ROWS = {
    "ddp": "Plain Accelerate DDP: `Accelerator(cpu=True)` + `accelerator.prepare(...)`, dp 4",
    "plugin": "`ZeroPPAccelerator(zeropp_plugin=ZeroPPPlugin(pp_size=2, num_microbatches=M), "
    "cpu=True)`, the identical loop (pp 2 x dp_shard 2, 1F1B over FSDP2)",
    "prepare_pipeline": "`prepare_pipeline(accelerator, model, opt, dl, sched, loss_fn=..., "
    "config=ZeroPPConfig(pp_size=2, num_microbatches=M))`, `engine.step(batch)` loop",
}
PG_TIMEOUT = datetime.timedelta(seconds=120)


def row_timeout_s(steps: int) -> float:
    """Start-up plus a generous 15 s a step (a step takes well under 1 s on 2 quiet cores)."""
    return harness.row_timeout_s(steps, start_s=240.0, per_step_s=15.0)


# ---------------------------------------------------------------------------------------- rank
def run_rank(row: str, opts: argparse.Namespace, out: Path) -> None:
    """One rank of one row: the loop's warm-up + timed steps; write this rank's JSON."""
    import torch

    total = opts.warmup + opts.steps
    rank = harness.start_rank(row_timeout_s(total))
    rss_start_kib = harness.max_rss_kib()
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
    clock = harness.StepClock(opts.warmup, opts.steps, inner=INNER)
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
        **harness.rss_figures(rss_start_kib),
    }
    harness.finish_rank(out, rank, result)


def _dims(dims: Any) -> dict[str, int]:
    return {
        "pp_rank": dims.pp_rank,
        "pp_size": dims.config.pp_size,
        "dp_rank": dims.dp_rank,
        "dp_size": dims.dp_size,
    }


# ---------------------------------------------------------------------------------------- driver
def summarize(row: str, run: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One run of one row: slowest rank per step, CPU, the machine's other load, memory."""
    per_step = harness.slowest_per_step([x["total"] for x in r["steps"]] for r in ranks)
    cpu_per_step = harness.summed_per_step([x["cpu"] for x in r["steps"]] for r in ranks)
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
        **harness.load_shares(ranks),
        "final_loss": ranks[0]["losses"][-1],
        "losses": ranks[0]["losses"],
        "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
        "per_rank": per_rank,
        "ranks": ranks,
    }


def main() -> None:
    parser = harness.arg_parser(__doc__, steps=10, warmup=3, repeats=2, rows=",".join(ROWS))
    parser.add_argument("--microbatches", type=int, default=4, help="per pipeline step")
    parser.add_argument("--per-device-batch", type=int, default=4, help="rows per process")
    parser.add_argument(
        "--render", action="store_true", help="only rewrite accelerate.md from accelerate.json"
    )
    args = parser.parse_args()
    if args.worker:
        run_rank(args.worker, args, Path(args.out))
        return
    if args.render:
        data = harness.read_results("accelerate")
        runs = data.pop("runs")
        print(harness.write_results("accelerate", markdown(data, runs)).read_text())
        return
    harness.check_counts(parser, args)
    if (args.per_device_batch * PP) % args.microbatches:
        parser.error("per-device batch x pp (rows per data-parallel rank) must split into M")
    names = harness.pick_rows(parser, args.rows, ROWS)
    meta_machine = harness.machine("accelerate", "transformers")
    start = time.monotonic()

    def one_run(name: str, run: int) -> dict[str, Any]:
        ranks = harness.launch(
            __file__,
            name,
            WORLD,
            row_timeout_s(args.warmup + args.steps),
            steps=args.steps,
            warmup=args.warmup,
            microbatches=args.microbatches,
            per_device_batch=args.per_device_batch,
        )
        return summarize(name, run, ranks)

    runs = harness.run_rows(
        names,
        args.repeats,
        one_run,
        lambda r: (
            f"setup {r['setup_s']:.2f}s, median step {r['median_step_s']:.3f}s, step CPU "
            f"{r['median_step_cpu_s']:.3f}s, CPU share {r['cpu_share']:.2f}, others "
            f"{r['others_share']:.2f}, steal {r['steal_share']:.2f}, loss {r['final_loss']:.4f}"
        ),
    )
    meta = {
        "machine": meta_machine,
        "library": ", ".join(sorted({lib for r in runs for lib in r["library"]})),
        "model": LLAMA,
        "params": param_count(),
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
                "step": harness.med(runs, name, "median_step_s")
                / harness.med(runs, "ddp", "median_step_s"),
                "step_cpu": harness.med(runs, name, "median_step_cpu_s")
                / harness.med(runs, "ddp", "median_step_cpu_s"),
            }
            for name in names
        }
    data = {**meta, "runs": runs}
    print(harness.write_results("accelerate", markdown(meta, runs), data).read_text())


if __name__ == "__main__":
    main()
