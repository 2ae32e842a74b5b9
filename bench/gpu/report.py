"""bench/results/gpu.md from one `bench/gpu/run.sh` run: the machine, each part's outcome, and
each part's own results (or the end of its log when it failed).

    python bench/gpu/report.py --state /tmp/gpu_run.XXXX [--results bench/results]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
PARTS = {  # part -> (what it is, the results file it writes)
    "tests": ("the suite's CUDA tests (`pytest -m gpu`)", None),
    "bench_1b": ("1B Llama bf16, plain Lightning vs ZeroPP (`bench/gpu/bench_1b.py`)", "gpu_1b.md"),
    "blocks": ("per-block times for the planner (`bench/gpu/block_times.py`)", "gpu_blocks.md"),
    "zeropp_w4": ("`bench/bench_zeropp.py`, 4 ranks, one core each", "gpu_zeropp_w4.md"),
    "zeropp_w8": ("`bench/bench_zeropp.py`, 8 ranks, one core each", "gpu_zeropp_w8.md"),
}


def machine() -> list[str]:
    lines = []
    try:
        import torch

        version = torch.__version__
        lines.append(
            f"- torch {version} (CUDA {torch.version.cuda}), Python {platform.python_version()}"
        )
        try:  # refuses a torch outside the supported range, naming it
            import lightning_zeropp  # noqa: F401
        except ImportError as err:
            lines.append(f"- **{err}**: every part below that imports it fails.")
        try:
            import transformers

            lines.append(f"- transformers {transformers.__version__}")
        except ImportError:
            lines.append("- transformers not installed")
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            lines.append(
                f"- GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, "
                f"{props.multi_processor_count} SMs"
            )
    except Exception as err:  # the report must be written whatever the environment
        lines.append(f"- torch not importable: {err}")
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if driver:
        lines.append(f"- driver {driver}")
    lines.append(f"- {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at the end")
    return lines


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def statuses(state: Path) -> dict[str, tuple[str, int]]:
    out = {}
    path = state / "status"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, rc, seconds = line.split()
        out[name] = (rc, int(seconds))
    return out


def outcome(rc: str) -> str:
    if rc == "skipped":
        return "skipped (budget spent)"
    if rc == "0":
        return "ok"
    if rc in ("124", "137"):
        return "**ran out of time**"
    return f"**failed (exit {rc})**"


def tests_summary(log: str) -> list[str]:
    """pytest's outcome lines: the summary, failures and errors, the slowest durations."""
    keep = [
        ln
        for ln in log.splitlines()
        if re.match(r"^(FAILED|ERROR|SKIPPED)", ln)
        or re.search(r"\d+ (passed|failed|error|skipped)", ln)
        or re.match(r"^\d+\.\d+s (call|setup)", ln)
    ]
    return ["```", *keep[-40:], "```"] if keep else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--dry-run", default="0")
    parser.add_argument("--elapsed", default="?")
    args = parser.parse_args()
    commit = _run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]) or "?"
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    title = "# GPU checks (`bench/gpu/run.sh`)"
    if args.dry_run == "1":
        title += " - DRY RUN on the CPU, tiny sizes: no GPU figure here"
    out = [title, "", f"{now}, commit {commit}, {args.elapsed} s in all.", "", *machine(), ""]
    found = statuses(args.state)
    out += ["| part | what | outcome | seconds |", "|---|---|---|---|"]
    for name, (what, _) in PARTS.items():
        rc, seconds = found.get(name, ("not run", 0))
        shown = outcome(rc) if rc != "not run" else "not run"
        out.append(f"| {name} | {what} | {shown} | {seconds} |")
    for name, (what, results) in PARTS.items():
        if name not in found:
            continue
        rc, _ = found[name]
        out += ["", f"## {name}: {what}", ""]
        log_path = args.state / f"{name}.log"
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        if name == "tests":
            out += tests_summary(log)
        elif results and (args.results / results).exists() and rc != "skipped":
            # written as it went: a part stopped early still shows what it measured
            text = (args.results / results).read_text().strip().splitlines()
            out += [ln for ln in text if not ln.startswith("# ")]  # its own title goes
        if rc == "skipped":
            out.append("Not run: the time budget was spent.")
        elif rc != "0":
            tail = log.splitlines()[-30:] or ["(no output)"]
            out += ["", "End of its log:", "", "```", *tail, "```"]
    path = args.results / "gpu.md"
    path.write_text("\n".join(out) + "\n")
    print(path.read_text())


if __name__ == "__main__":
    main()
