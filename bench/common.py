"""What every benchmark here shares: launching a row's ranks as fresh processes, and the machine.

Each row runs in its own processes (so its peak memory is its own) under a deadline; a rank that
fails or a row that runs past its deadline fails loudly with the tail of every rank's log, and a
rank that hangs in process-group teardown after writing its figures is killed (seen once with
gloo: rank 0, holder of the TCP store).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def launch_ranks(
    script: str,
    row: str,
    world: int,
    args: list[str],
    timeout_s: float,
    placement: Any = None,
) -> list[dict[str, Any]]:
    """Run `script --worker ROW --out DIR ARGS` on `world` fresh ranks; each writes rank{r}.json.

    `placement` (e.g. `netns.EmulatedCluster`) puts rank r under `placement.command_prefix(r)`
    with `placement.env(r)` added to its environment (its node, address and interface)."""
    with tempfile.TemporaryDirectory(prefix=f"bench_{row}_") as tmp:
        out = Path(tmp)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs, logs = [], []
        for rank in range(world):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "NODE_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(ROOT),
            }
            cmd = [sys.executable, script, "--worker", row, "--out", tmp, *args]
            if placement is not None:
                env.update(placement.env(rank))
                cmd = [*placement.command_prefix(rank), *cmd]
            log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log))
        deadline = time.monotonic() + timeout_s
        results = [out / f"rank{r}.json" for r in range(world)]
        done_at: float | None = None
        try:
            while any(p.poll() is None for p in procs):
                failed = any(p.poll() not in (None, 0) for p in procs)
                if failed or time.monotonic() > deadline:
                    time.sleep(1.0 if failed else 0.0)  # let the others print their error
                    break
                if done_at is None and all(f.exists() for f in results):
                    done_at = time.monotonic()
                if done_at is not None and time.monotonic() > done_at + 20.0:
                    stuck = [r for r, p in enumerate(procs) if p.poll() is None]
                    print(f"{row}: ranks {stuck} still running 20 s after their results; killed.")
                    for r in stuck:
                        print("\n".join(read_tail(out / f"rank{r}.log", 30)))
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            for log in logs:
                log.close()
        # ranks that exit right after writing can all be gone before a poll saw their files
        written = all(f.exists() for f in results)
        if not written or any(p.returncode not in (0, -9) for p in procs):
            tails = "\n".join(
                f"--- rank {r} ---\n" + "\n".join(read_tail(out / f"rank{r}.log"))
                for r in range(world)
            )
            raise RuntimeError(
                f"row {row!r} failed: exit codes {[p.returncode for p in procs]}\n{tails}"
            )
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def read_tail(path: Path, lines: int = 20) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-lines:]


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(  # results written by earlier runs are not code changes
        ["git", "status", "--porcelain", "--", ".", ":!bench/results"],
        cwd=ROOT, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average_1m_at_start": os.getloadavg()[0],
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit + (" (uncommitted changes)" if dirty else ""),
    }


def proc_stat() -> dict[str, int]:
    """The machine's CPU time by kind (jiffies, all cores), from /proc/stat's first line.

    `steal` is time the hypervisor gave this machine's virtual CPUs to other guests: process CPU
    time does not see it, so a run can show a CPU share near 1 and still be slowed by it.
    """
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return {}
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return {n: int(v) for n, v in zip(names, fields, strict=False)}
