"""The harness the benchmarks share: rows of fresh rank processes, timed step by step.

A benchmark here is one script that is both the driver (the command a person runs) and the rank
(the same script, started by the driver with `--worker ROW --out DIR` and the options it names).
The driver runs each row in fresh processes (`launch`: its peak memory is its own; a failed or
late rank fails the row loudly with every rank's log tail), `--repeats` times in alternating order
(`run_rows`: ABC CBA ..., so that no row always runs first on a machine whose speed drifts),
reduces the ranks' JSON to one summary per run and writes `bench/results/<stem>.md` and `.json`
(`write_results`; `BENCH_RESULTS=dir` writes them elsewhere) headed by the machine, date and
commit (`machine`, `machine_lines`). Used by bench_fronts, bench_lightning, bench_accelerate and
bench_zeropp; a new benchmark of rows x ranks x timed steps (a Trainer front, a compiled step)
should be written on it the same way.

Driver side::

    parser = harness.arg_parser(__doc__, steps=6, warmup=2, repeats=2, rows=",".join(ROWS))
    args = parser.parse_args()                     # add the benchmark's own options first
    if args.worker:
        return run_rank(args.worker, args, Path(args.out))
    harness.check_counts(parser, args)
    names = harness.pick_rows(parser, args.rows, ROWS)
    info = harness.machine("lightning")            # at the start: the load average then
    runs = harness.run_rows(names, args.repeats, one_run, progress)
    harness.write_results("stem", markdown(meta, runs), {**meta, "runs": runs})

`one_run(name, run)` calls `harness.launch(__file__, name, WORLD, timeout_s, steps=...,
warmup=...)` (each keyword reaches the rank as `--steps ...`; `row_timeout_s` makes a deadline)
and reduces the rank results it returns: `slowest_per_step` (a step takes as long as its slowest
rank), `summed_per_step` (e.g. a step's CPU seconds over all ranks), `load_shares` (the ranks'
CPU share of the cores, other processes' share and steal over the timed steps: whether the run
was disturbed), `med` (the median of a figure over a row's runs). `progress(summary)` is the text
printed after each run. Markdown helpers: `machine_lines` (the header's machine and date lines),
`runs_lines` (its steps and runs line and the table of rows), `table`.

Rank side (in harness_rank.py, re-exported here)::

    rank = harness.start_rank(timeout_s)           # one thread, a traceback before the deadline
    rss0 = harness.max_rss_kib()
    clock = harness.StepClock(warmup, steps)       # inner=, profiler=, reduce_loss= optional
    for each step: clock.start(); ...; clock.lap("forward"); ...; clock.stop(loss)
    harness.finish_rank(out, rank, {**clock.result(), **harness.rss_figures(rss0), ...})

`StepClock.start` puts every rank's step behind a barrier, so a step's time is its own and not
the ranks' skew; the clock records each step's wall and CPU time, optional laps (the step's time
split by code line), wrapped inner calls (`wrap`), an optional cProfile over the timed steps, and
over the timed window this process's CPU time, wall time and the machine's /proc/stat (which
`load_shares` reads). `slowest(times)` all-reduces per-step times to the slowest rank's on the
rank. `finish_rank` writes the rank's JSON atomically (the driver waits for the complete file)
and tears the process group down on every rank together.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from common import ROOT, launch_ranks
from common import machine as common_machine
from harness_rank import (
    StepClock,
    finish_rank,
    max_rss_kib,
    process_start,
    rss_figures,
    slowest,
    start_rank,
)

__all__ = [
    "MIB",
    "RESULTS",
    "StepClock",
    "alternating",
    "arg_parser",
    "check_counts",
    "finish_rank",
    "launch",
    "load_shares",
    "machine",
    "machine_lines",
    "max_rss_kib",
    "med",
    "pick_rows",
    "process_start",
    "read_results",
    "row_timeout_s",
    "rss_figures",
    "run_rows",
    "runs_lines",
    "slowest",
    "slowest_per_step",
    "start_rank",
    "summed_per_step",
    "table",
    "write_results",
]

RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
MIB = 2**20


# ------------------------------------------------------------------------------------- driver
def arg_parser(
    doc: str, *, steps: int, warmup: int, rows: str, repeats: int | None = None
) -> argparse.ArgumentParser:
    """--steps, --warmup, --rows (and --repeats), plus the hidden --worker / --out of a rank."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps before them")
    if repeats is not None:
        parser.add_argument(
            "--repeats", type=int, default=repeats, help="runs per row, alternating"
        )
    parser.add_argument("--rows", default=rows, help="comma-separated subset of the rows")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser


def check_counts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1 and --warmup at least 0")


def pick_rows(parser: argparse.ArgumentParser, text: str, known: Iterable[str]) -> list[str]:
    """The comma-separated row names in `text`, each one of `known` (else a usage error)."""
    names, known = [r for r in text.split(",") if r], list(known)
    unknown = set(names) - set(known)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from {known}")
    return names


def row_timeout_s(steps: int, start_s: float, per_step_s: float) -> float:
    """A row's deadline: start-up plus a generous allowance per step (warm-up included)."""
    return start_s + per_step_s * steps


def launch(
    script: str, row: str, world: int, timeout_s: float, /, placement: Any = None, **options: Any
) -> list[dict[str, Any]]:
    """One row on `world` fresh ranks of `script`; each option `name=value` is passed to the rank
    as `--name value` (underscores as dashes). Returns the ranks' results, in rank order; fails
    loudly with every rank's log tail on an error or past the deadline (`common.launch_ranks`)."""
    args = [str(a) for k, v in options.items() for a in (f"--{k.replace('_', '-')}", v)]
    return launch_ranks(script, row, world, args, timeout_s, placement)


def alternating(names: Sequence[str], repeats: int) -> Iterator[tuple[int, str]]:
    """(run, name) for runs 1..repeats, the rows in order on odd runs, reversed on even ones."""
    for run in range(1, repeats + 1):
        yield from ((run, name) for name in (names if run % 2 else names[::-1]))


def run_rows(
    names: Sequence[str],
    repeats: int,
    one_run: Callable[[str, int], dict[str, Any]],
    progress: Callable[[dict[str, Any]], str],
) -> list[dict[str, Any]]:
    """Every row `repeats` times, alternating; prints `run R NAME: <progress(summary)> (Ns)`."""
    runs = []
    for run, name in alternating(names, repeats):
        t0 = time.monotonic()
        runs.append(one_run(name, run))
        print(f"run {run} {name}: {progress(runs[-1])} ({time.monotonic() - t0:.0f}s)", flush=True)
    return runs


def machine(*packages: str, library_only: bool = False) -> dict[str, Any]:
    """`common.machine()` (CPU, cores, load, date, torch, Python, commit) plus the versions of
    `packages`. `library_only`: mark the commit dirty only for changes outside bench/ (the
    library's code, which is what is measured)."""
    info = {**common_machine(), **{p: importlib.import_module(p).__version__ for p in packages}}
    if library_only:
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", ".", ":(exclude)bench"],
            cwd=ROOT, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        commit = info["commit"].split(" ", 1)[0]
        info["commit"] = commit + (" (uncommitted changes outside bench/)" if dirty else "")
    return info


def write_results(
    stem: str, lines: Sequence[str], data: dict[str, Any] | None = None, indent: int = 1
) -> Path:
    """Write RESULTS/<stem>.md (the lines) and, unless `data` is None (a re-render of a saved
    run), RESULTS/<stem>.json; return the .md's path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    md = RESULTS / f"{stem}.md"
    md.write_text("\n".join(lines) + "\n")
    if data is not None:
        (RESULTS / f"{stem}.json").write_text(json.dumps(data, indent=indent) + "\n")
    return md


def read_results(stem: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{stem}.json").read_text())


# ---------------------------------------------------------------------------------- summaries
def slowest_per_step(series: Iterable[Sequence[float]]) -> list[float]:
    """Per step, the slowest rank's time (one sequence of step times per rank)."""
    return [max(s) for s in zip(*series, strict=True)]


def summed_per_step(series: Iterable[Sequence[float]]) -> list[float]:
    """Per step, the sum over the ranks (e.g. the CPU seconds a step costs)."""
    return [sum(s) for s in zip(*series, strict=True)]


def load_shares(ranks: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Who had the cores over the timed steps, from the ranks' `StepClock.result()`.

    cpu_share: the ranks' CPU time per core-second of wall time (near 1: the cores were theirs);
    others_share: other processes' CPU time on the machine, per core-second (/proc/stat busy time
    minus the ranks' own); steal_share: the hypervisor's share of the machine's CPU time.
    """
    wall = max(r["timed_wall_s"] for r in ranks) * (os.cpu_count() or 1)
    ranks_cpu = sum(r["timed_cpu_s"] for r in ranks)
    stat = ranks[0]["timed_proc_stat"]  # machine-wide: any rank's view will do
    ticks = sum(stat.values())
    busy_s = (ticks - stat.get("idle", 0) - stat.get("iowait", 0)) / os.sysconf("SC_CLK_TCK")
    return {
        "cpu_share": ranks_cpu / wall,
        "others_share": max(0.0, busy_s - ranks_cpu) / wall,
        "steal_share": stat.get("steal", 0) / ticks if ticks else float("nan"),
    }


def med(runs: Iterable[dict[str, Any]], row: str, key: str) -> float:
    """The median of `key` over the runs of `row`."""
    return statistics.median(r[key] for r in runs if r["row"] == row)


# ----------------------------------------------------------------------------------- Markdown
def machine_lines(
    m: dict[str, Any],
    world: int,
    packages: Sequence[str],
    threads: str = "OMP_NUM_THREADS=1",
    library: str | None = None,
) -> list[str]:
    """The results header's machine and date lines (versions of torch and `packages`)."""
    versions = ", ".join(f"{p} {m[p]}" for p in ("torch", *packages))
    return [
        f"- Machine: {m['cpu']}, {m['cores']} cores, shared with other work (1-minute load "
        f"average {m['load_average_1m_at_start']:.1f} at the start); {world} gloo ranks, "
        f"{threads} each",
        f"- Date: {m['date']}; {versions}; Python {m['python']}; commit {m['commit']}"
        + (f"; library measured: {library}" if library else ""),
    ]


def runs_lines(meta: dict[str, Any], world: int, titles: dict[str, str]) -> list[str]:
    """The header's last line (steps, runs per row, the script's wall time), then the rows run:
    `titles` maps each row's name to what it runs, in the order of the results."""
    return [
        f"- {meta['warmup']} warm-up steps, then {meta['steps']} timed steps; runs per row: "
        f"{meta['repeats']}, each in {world} fresh processes, rows alternating their order; whole "
        f"script {meta['wall_s']:.0f} s",
        "",
        *table(["Row", "Layout"], "ll", ([f"`{r}`", t] for r, t in titles.items())),
    ]


def table(head: Sequence[str], align: str, rows: Iterable[Sequence[Any]]) -> list[str]:
    """A Markdown table; `align` has one letter per column: l (left) or r (right)."""
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align)
    return [_cells(head), rule, *(_cells(r) for r in rows)]


def _cells(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"
