"""Run a scenario on N gloo ranks as separate processes, with a hard timeout and readable failures."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    world_size: int,
    scenario: str,
    params: dict[str, Any],
    out_dir: Path,
    timeout: float = 300.0,
) -> list[Any]:
    """Start `world_size` ranks of `tests.distributed.worker`; return each rank's result object.

    A rank that fails, or a run that outlives `timeout`, fails the calling test with the tail of
    every rank's log (all ranks are killed first: no test can hang).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        cmd = [sys.executable, "-m", "tests.distributed.worker", scenario, json.dumps(params)]
        procs.append(
            subprocess.Popen([*cmd, str(out_dir)], cwd=ROOT, env=env, stdout=log, stderr=log)
        )
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{scenario} on {world_size} ranks ran past {timeout:.0f}s")
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2.0)  # give the other ranks a moment to print their own error
                break
            time.sleep(0.1)
    except TimeoutError as err:
        _kill(procs)
        raise AssertionError(f"{err}\n{_tails(out_dir, world_size)}") from None
    finally:
        for log in logs:
            log.close()
    _kill(procs)
    codes = [p.returncode for p in procs]
    if any(c != 0 for c in codes):
        raise AssertionError(f"ranks exited with {codes}\n{_tails(out_dir, world_size)}")
    return [torch.load(out_dir / f"result{r}.pt", weights_only=False) for r in range(world_size)]


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def _tails(out_dir: Path, world_size: int, lines: int = 25) -> str:
    parts = []
    for r in range(world_size):
        text = (out_dir / f"rank{r}.log").read_text(errors="replace").splitlines()
        parts.append(f"--- rank {r} ---\n" + "\n".join(text[-lines:]))
    return "\n".join(parts)
