"""How long the planner's search takes: `python -m lightning_zeropp.plan` for Llama-7B on 32 H100
and Llama-70B on 128 H100 at their context length (4096), each in a fresh process.

    python bench/bench_planner_search.py [--runs 2]

Reports the wall time and the CPU time of the whole command (imports, model on the meta device,
profile, search), the best of `--runs`; on one core the CPU time is what a quiet machine's wall
time would be. Writes bench/results/planner_search.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
CASES = {
    "Llama-7B on 32 H100 (h100_4x8)": ["model=llama_7b", "cluster=h100_4x8"],
    "Llama-70B on 128 H100 (h100_16x8)": ["model=llama_70b", "cluster=h100_16x8"],
}
TARGETS = {"Llama-7B on 32 H100 (h100_4x8)": 10.0, "Llama-70B on 128 H100 (h100_16x8)": 30.0}


def timed(args: list[str]) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, its output) of one planner command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "lightning_zeropp.plan", *args, "write=none", "top=3"],
        cwd=ROOT, capture_output=True, text=True, check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    where = machine()
    rows = []
    for name, case in CASES.items():
        runs = [timed(case) for _ in range(args.runs)]
        wall, cpu, out = min(runs, key=lambda r: r[1])
        best = next((line for line in out.splitlines() if line.strip().startswith("1 ")), "")
        rows.append((name, wall, cpu, best.strip()))
        print(f"{name}: {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)
    lines = [
        "# The planner's search time",
        "",
        f"- Machine: {where['cpu']}, {where['cores']} cores; load average "
        f"{where['load_average_1m_at_start']:.1f} at the start; {where['date']}; commit "
        f"{where['commit']}",
        f"- `python -m lightning_zeropp.plan model=... cluster=... write=none top=3`, one thread, "
        f"best of {args.runs} fresh processes at nice {os.nice(0)}; CPU time is the command's "
        "(one core's) total, the figure the targets are held to: on a loaded machine the wall "
        "time says how busy the machine was",
        "",
        "| Case | Wall (s) | CPU (s) | Target (s) | Best layout |",
        "|---|---:|---:|---:|---|",
    ]
    for name, wall, cpu, best in rows:
        lines.append(f"| {name} | {wall:.1f} | {cpu:.1f} | {TARGETS[name]:.0f} | `{best}` |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "planner_search.md").write_text("\n".join(lines) + "\n")
    print((RESULTS / "planner_search.md").read_text())


if __name__ == "__main__":
    main()
