"""Run the tests marked `slow`: cases CI leaves out to keep the suite under 15 minutes on 2 cores.

They are real tests (parity, restarts under torchrun), kept out of `.ci/run` only for time; run
them before a release or after touching what they guard:

    .venv/bin/python bench/slow_tests.py            # every slow test
    .venv/bin/python bench/slow_tests.py -k elastic  # extra pytest arguments pass through

Writes `bench/results/slow_tests.md`: the machine, date and commit, the pytest summary line and
the slowest durations, and exits with pytest's code.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine  # noqa: E402


def main(extra: list[str]) -> int:
    facts = machine()
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "slow", "--durations=15", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    took = time.monotonic() - start
    sys.stdout.write(proc.stdout[-20000:])
    sys.stderr.write(proc.stderr[-5000:])
    lines = proc.stdout.splitlines()
    # pytest -q ends with "8 passed, 1342 deselected in 286.05s (0:04:46)" (no "=" banner)
    words = (" passed", " failed", " error", " deselected", "no tests ran")
    summary = next(
        (ln for ln in reversed(lines) if " in " in ln and any(w in ln for w in words)),
        "(no summary)",
    )
    durations = [ln for ln in lines if ln[:1].isdigit() and "s " in ln[:10]]
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    text = [
        "# Slow tests (`pytest -m slow`)",
        "",
        f"Machine: {json.dumps(facts)}",
        "",
        f"Command: `{' '.join(cmd[1:])}`; exit code {proc.returncode}; {took:.0f} s wall.",
        "",
        f"Summary: `{summary.strip('= ')}`",
        "",
        "Slowest:",
        "",
        *(f"    {ln}" for ln in durations),
        "",
    ]
    (results / "slow_tests.md").write_text("\n".join(text))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
