"""The Markdown of bench_accelerate.py: summary, where a step's time goes by loop line, every run.

`markdown(meta, runs)` renders what the benchmark wrote to accelerate.json (the benchmark's
`--render` re-renders a saved file); `_breakdown` sets each loop line's time per row beside DDP's
and the 1F1B bubble expectation beside the measured ratios.
"""

from __future__ import annotations

import statistics
from typing import Any

from accelerate_loop import CLIP, LLAMA, LR, PHASES, PP, SEQ, WEIGHT_DECAY, stage_work
from harness import MIB, machine_lines, med, runs_lines

__all__ = ["markdown"]


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


def markdown(meta: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    """The Markdown of one benchmark run (`meta` and its `runs`, as in accelerate.json)."""
    world = meta["world_size"]
    titles = {r["row"]: r["title"] for r in runs}
    rows = list(dict.fromkeys(r["row"] for r in runs))
    mb = meta["microbatches"]
    bubble = (PP - 1) / (mb + PP - 1)
    b = meta["per_device_batch"]
    lines = [
        "# A run_clm-shaped HF loop: plain Accelerate DDP vs ZeroPPAccelerator vs prepare_pipeline",
        "",
        *machine_lines(
            meta["machine"],
            world,
            ("accelerate", "transformers"),
            threads="OMP_NUM_THREADS=1 and `torch.set_num_threads(1)`",
            library=meta["library"],
        ),
        '- Model: `AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", '
        + ", ".join(f"{k}={v}" for k, v in LLAMA.items())
        + f"))`, {meta['params'] / 1e6:.2f} M parameters, fp32, the same initial weights in "
        "every row",
        f"- Data: rows of {SEQ * 3 // 4}-{SEQ} tokens right-padded to {SEQ} (`input_ids`, "
        "`attention_mask`, `labels` = -100 on the padding), in order (no shuffling); global "
        f"batch {b * world} rows per step in every row: per-device batch {b} x {world} processes "
        f"(`ddp`, `plugin`), {b * PP} rows per data-parallel rank x 2 (`prepare_pipeline`)",
        f"- Loop: AdamW lr {LR} over run_clm's decay / no-decay groups (weight decay "
        f"{WEIGHT_DECAY}), `get_scheduler('cosine')`, clipping at {CLIP}; pipelines: pp {PP} x "
        f"dp_shard 2, 1F1B over FSDP2, {mb} micro-batches, `split='auto'`",
        *runs_lines(meta, world, titles),
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
        step = med(runs, row, "median_step_s")
        cpu = med(runs, row, "median_step_cpu_s")
        vs = f"{step / med(runs, 'ddp', 'median_step_s'):.2f}" if has_ddp else "-"
        cpu_vs = f"{cpu / med(runs, 'ddp', 'median_step_cpu_s'):.2f}" if has_ddp else "-"
        fastest = min(min(r["step_times_s"]) for r in runs if r["row"] == row)
        rss = statistics.median(max(r["peak_rss_bytes_per_rank"]) for r in runs if r["row"] == row)
        loss = statistics.median(r["final_loss"] for r in runs if r["row"] == row)
        lines.append(
            f"| `{row}` | {med(runs, row, 'setup_s'):.2f} | {med(runs, row, 'accelerator_s'):.2f} "
            f"| {step:.3f} | {vs} | {fastest:.3f} | {cpu:.3f} | {cpu_vs} | "
            f"{med(runs, row, 'cpu_share'):.2f} | {med(runs, row, 'others_share'):.2f} | "
            f"{med(runs, row, 'steal_share'):.2f} | {rss / MIB:.0f} | {loss:.4f} |"
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
    return lines


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
    last_work = stage_work(last_stage=True)
    expect = last_work / (1 - bubble)
    lines += [
        "",
        f"Expectation for the pipeline rows: pp {PP} with M = {mb} micro-batches under 1F1B "
        f"leaves each stage idle for (pp-1)/(M+pp-1) = {PP - 1}/{mb + PP - 1} = {bubble:.0%} of "
        "the schedule, so with balanced stages and free communication a step takes "
        f"{1 / (1 - bubble):.2f}x one stage's compute. A pipeline rank runs half the decoder "
        "layers for twice a DDP rank's rows (the same layer work), plus the LM head and loss for "
        f"twice the rows on the last stage: its matmul work is {last_work:.2f}x a DDP rank's "
        f"(first stage: {stage_work(last_stage=False):.2f}x), so with one core per rank (a "
        f"GPU-like setting) the pipelined forward + backward would take about {expect:.2f}x "
        "DDP's, before FSDP2's all-gathers and reduce-scatter over 2 ranks and the activations "
        "sent between the stages.",
    ]
    if "ddp" in rows:
        for row in (r for r in rows if r != "ddp"):
            fb = cell(row, "fwd_bwd") / cell("ddp", "fwd_bwd")
            step = med(runs, row, "median_step_s") / med(runs, "ddp", "median_step_s")
            cpu = med(runs, row, "median_step_cpu_s") / med(runs, "ddp", "median_step_cpu_s")
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
