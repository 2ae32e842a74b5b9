"""Run a scenario on N gloo ranks as separate processes, with a hard timeout and readable failures.

Ranks are forked from a server that has already imported torch, Lightning, Accelerate and
transformers (`zygote`): a launch then costs no import time per rank. They are still separate
processes with their own process groups; `LZPP_TESTS_FRESH_PROCESSES=1` starts each rank as a
fresh interpreter instead. `LZPP_TESTS_PROFILE=1` has each rank write the CPU-time profile of its
scenario (`profile{rank}.prof` beside its log; read it with `pstats`): where a slow launch spends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
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
    memory_cap: int | None = None,
) -> list[Any]:
    """Start `world_size` ranks of `tests.distributed.worker`; return each rank's result object.

    `memory_cap` (bytes): each rank starts as a fresh process that joins a memory cgroup of its
    own limited to that, before it imports anything (`cgroup.join_memory_cgroup`), so the cap
    covers the whole process; a forked rank would share memory the server allocated uncapped.

    A rank that fails, or a run that outlives `timeout`, fails the calling test with the tail of
    every rank's log (all ranks are killed first: no test can hang).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(world_size):  # a directory used twice must not return the last run's
        (out_dir / f"result{rank}.pt").unlink(missing_ok=True)
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
        argv = [scenario, json.dumps(params), str(out_dir)]
        if memory_cap is not None:
            env["LZPP_TESTS_MEMORY_CAP"] = str(memory_cap)
            # glibc otherwise raises its mmap threshold to each large block freed, and blocks of
            # that size then come from the heap and stay resident when freed (the caps emulate a
            # device's memory, whose allocator returns them).
            env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
        forked = (
            None
            if memory_cap is not None
            else _fork(env, argv, out_dir / f"rank{rank}.log", out_dir / f".exit{rank}")
        )
        if forked is not None:
            procs.append(forked)
            continue
        log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        cmd = [sys.executable, "-m", "tests.distributed.worker", *argv]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log))
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
        state = _dump_stacks(procs, out_dir)
        _kill(procs)
        raise AssertionError(f"{err}; {state}\n{_tails(out_dir, world_size, 60)}") from None
    finally:
        for log in logs:
            log.close()
    _kill(procs)
    codes = [p.returncode for p in procs]
    if any(c != 0 for c in codes):
        raise AssertionError(f"ranks exited with {codes}\n{_tails(out_dir, world_size)}")
    return [torch.load(out_dir / f"result{r}.pt", weights_only=False) for r in range(world_size)]


class _Forked:
    """A rank forked by the zygote, with the part of `Popen`'s interface `launch` uses."""

    def __init__(self, pid: int, exit_file: Path) -> None:
        self.pid, self._exit_file = pid, exit_file
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._exit_file.exists():
            self.returncode = int(self._exit_file.read_text())
        elif self.returncode is None and not Path(f"/proc/{self.pid}").exists():
            # Gone (reaped) without an exit file: the server that forked it is gone too. A rank
            # that ends on its own writes its code before it exits, so it was killed.
            if not self._exit_file.exists():
                self.returncode = -signal.SIGKILL
            return self.poll()
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            for kill in (os.killpg, os.kill):  # its own group, unless it has not set it yet
                with contextlib.suppress(ProcessLookupError):
                    kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float = 60.0) -> int | None:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.returncode


_server: subprocess.Popen | None = None


def _fork(env: dict[str, str], argv: list[str], log: Path, exit_file: Path) -> _Forked | None:
    """Fork a rank from the zygote (started on first use); None when ranks start fresh."""
    global _server
    if os.environ.get("LZPP_TESTS_FRESH_PROCESSES") == "1":
        return None
    if _server is None or _server.poll() is not None:
        server_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        _server = subprocess.Popen(
            [sys.executable, "-m", "tests.distributed.zygote"],
            cwd=ROOT,
            env=server_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    assert _server.stdin is not None and _server.stdout is not None
    exit_file.unlink(missing_ok=True)  # a directory used twice must not report the last run
    request = {"env": env, "argv": argv, "log": str(log), "exit_file": str(exit_file)}
    _server.stdin.write(json.dumps(request) + "\n")
    _server.stdin.flush()
    reply = _server.stdout.readline()
    if not reply:
        raise RuntimeError("the test rank server (tests.distributed.zygote) died; see its output")
    return _Forked(json.loads(reply)["pid"], exit_file)


def _dump_stacks(procs: list[Any], out_dir: Path) -> str:
    """Ask every live rank for its threads' stacks (the worker's SIGUSR1 handler writes them to
    its log); return which ranks were still running and which had written their result."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGUSR1)
    time.sleep(2.0)
    return ", ".join(
        f"rank {r}: "
        + ("running" if p.poll() is None else f"exit {p.returncode}")
        + (", result written" if (out_dir / f"result{r}.pt").exists() else "")
        for r, p in enumerate(procs)
    )


def _kill(procs: list[Any]) -> None:
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
