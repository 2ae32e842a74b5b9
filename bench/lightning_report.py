"""The Markdown of bench_lightning.py: summary, a before / now table, setup phases, every run, profiles.

`markdown(...)` renders what the benchmark wrote to <out-name>.json (`--render` re-renders a saved
file), beside an earlier run's JSON when one is given (each run's ratios to `fsdp` are the
figures that survive a busier machine best).
"""

from __future__ import annotations

import statistics
from typing import Any

from harness import MIB, machine_lines, med, runs_lines
from lightning_profile import profile_section

__all__ = ["markdown"]


def markdown(
    meta: dict[str, Any],
    runs: list[dict[str, Any]],
    profiles: list[dict[str, Any]],
    baseline: dict[str, Any] | None,
    *,
    phases: dict[str, str],
    lr: float,
) -> list[str]:
    """The Markdown of one benchmark run (as in <out-name>.json), beside `baseline` if given;
    `phases`: the setup marks (name: what ended just before it), `lr`: AdamW's."""
    world = meta["world_size"]
    titles = {r["row"]: r["title"] for r in runs}
    rows = list(dict.fromkeys(r["row"] for r in runs))
    ref = "fsdp" if "fsdp" in rows else None
    lines = [
        "# The Lightning front's cost: ZeroPPStrategy vs Lightning's DDP and FSDP",
        "",
        *machine_lines(meta["machine"], world, ("lightning",), library=meta["library"]),
        f"- Model: `LitGPT(GPTConfig({', '.join(f'{k}={v}' for k, v in meta['model'].items())}))`, fp32; "
        f"global batch {meta['global_batch']} sequences (the same every step), split over the "
        f"data-parallel ranks; AdamW lr {lr}; no clipping; `logger=False`, no progress bar, no "
        "checkpointing, no validation; `train_loss` logged with `sync_dist=True` (LitGPT's own)",
        *runs_lines(meta, world, titles),
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
        step = med(runs, row, "median_step_s")
        fit = med(runs, row, "fit_wall_s")
        vs_ref = f"{step / med(runs, ref, 'median_step_s'):.2f}" if ref else "-"
        cpu = med(runs, row, "median_step_cpu_s")
        fastest = min(min(r["step_times_s"]) for r in runs if r["row"] == row)
        cpu_ref = f"{cpu / med(runs, ref, 'median_step_cpu_s'):.2f}" if ref else "-"
        vs_ddp = f"{step / med(runs, 'ddp', 'median_step_s'):.2f}" if "ddp" in rows else "-"
        fit_ddp = f"{fit / med(runs, 'ddp', 'fit_wall_s'):.2f}" if "ddp" in rows else "-"
        rss = statistics.median(max(r["peak_rss_bytes_per_rank"]) for r in runs if r["row"] == row)
        loss = next(r["final_loss"] for r in runs if r["row"] == row)
        lines.append(
            f"| `{row}` | {med(runs, row, 'setup_s'):.1f} | {step:.2f} | {vs_ref} | {vs_ddp} | "
            f"{fastest:.2f} | {cpu:.2f} | {cpu_ref} | {fit:.1f} | {fit_ddp} | {med(runs, row, 'process_to_first_batch_s'):.1f} | "
            f"{rss / MIB:.0f} | {loss:.4f} |"
        )
    if baseline is not None:
        lines += _baseline_table(baseline, runs, rows)
    lines += [
        "",
        "## Setup phases (median over runs; seconds since just before `pl.Trainer(...)`, slowest "
        "rank at each mark)",
        "",
        "| Row | " + " | ".join(phases) + " |",
        "|---|" + "---:|" * len(phases),
    ]
    for row in rows:
        cells = [
            statistics.median(r["setup_phases_s"][p] for r in runs if r["row"] == row)
            for p in phases
        ]
        lines.append(f"| `{row}` | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    lines += ["", *(f"- `{p}`: {d}" for p, d in phases.items())]
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
        lines += profile_section(p, world)
    return lines


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
        return f"{med(rs, row, key) / med(rs, 'fsdp', key):.2f}"

    def pair(row: str, key: str, fmt: str) -> str:
        return " / ".join(
            format(med(rs, row, key), fmt) if all(key in r for r in rs) else "-"
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
