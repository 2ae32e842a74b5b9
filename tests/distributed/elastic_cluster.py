"""torchrun agents on emulated hosts: one `torch.distributed.run` per host, each in a UTS
namespace of the host's name (`unshare --uts`), optionally inside that host's network namespace
(`hosts_cluster.TwoLinks`), all meeting at torchrun's c10d rendezvous hosted by the first
(`--rdzv-conf is_host=1`). Ranks are numbered by the rendezvous (no `--node-rank`). Each agent
writes its workers' output under `<out>/agent<k>/` (`--log-dir`, `--redirects 3`), attempt by
attempt. Needs root (`hosts_cluster.unavailable`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.distributed.hosts_cluster import TwoLinks
from tests.distributed.launch import ROOT, free_port

__all__ = ["run_agents", "worker_logs"]


def run_agents(
    scenario: str,
    params: dict[str, Any],
    out_dir: Path,
    nnodes: str = "1:2",
    nproc: int = 2,
    max_restarts: int = 1,
    names: tuple[str, ...] = ("nodeA", "nodeB"),
    links: TwoLinks | None = None,
    timeout: float = 600.0,
    last_call_s: int = 20,
    launcher: str = "torchrun",
) -> list[int | str]:
    """Start one agent per name; return each agent's exit code ("timeout" if it ran past
    `timeout`: then every agent and its workers are killed). `launcher="accelerate"`: `accelerate
    launch` with one task per host (`--num_machines`, `--machine_rank k`, `--main_process_ip`
    the first host's), which starts torchrun's agent with a static rendezvous; `nnodes` and
    `max_restarts` are then torchrun's only."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    endpoint = f"{'127.0.0.1' if links is None else links.data_address(0)}:{port}"
    procs, logs, workers = [], [], []
    for host, name in enumerate(names):
        local_addr = "127.0.0.1" if links is None else links.data_address(host)
        conf = f"is_host={int(host == 0)},last_call_timeout={last_call_s}"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}"]
        cmd += [f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}"]
        cmd += ["--rdzv-id=lzpp", f"--rdzv-conf={conf}", f"--local-addr={local_addr}"]
        cmd += [f"--max-restarts={max_restarts}", "--monitor-interval=0.5"]
        cmd += [f"--log-dir={out_dir / f'agent{host}'}", "--redirects=3"]
        if launcher == "accelerate":
            cmd = _accelerate(endpoint, host, len(names), nproc)
        cmd += ["-m", "tests.distributed.worker", scenario, json.dumps(params), str(out_dir)]
        inner = f'hostname {name} && exec "$@"'
        cmd = ["unshare", "--uts", "sh", "-c", inner, "sh", *cmd]
        if links is not None:
            cmd = ["ip", "netns", "exec", links.ns(host), *cmd]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        # A restarted attempt must not read the previous attempt's addresses from the agents'
        # shared store (pytorch/pytorch#135712; test_resume's torchrun case says more).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if links is not None:
            env["GLOO_SOCKET_IFNAME"] = links.data_dev(host)
        log = open(out_dir / f"agent{host}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        # A session per agent; its workers start sessions of their own (torchrun's handler),
        # found again by their parent pid when a run must be stopped.
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log, start_new_session=True)
        )
    deadline = time.monotonic() + timeout
    codes: list[int | str] = []
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.5)
        codes = [p.returncode if p.returncode is not None else "timeout" for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                workers += _children(p.pid)
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        for log in logs:
            log.close()
    return codes


def _accelerate(endpoint: str, machine: int, machines: int, nproc: int) -> list[str]:
    """`accelerate launch` as a user runs it on machine `machine` (no config file: `--multi_gpu`
    is its multi-process mode on any device; the script builds its accelerator with `cpu=True`)."""
    ip, port = endpoint.split(":")
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu"]
    cmd += [f"--num_machines={machines}", f"--machine_rank={machine}"]
    cmd += [f"--num_processes={machines * nproc}", f"--main_process_ip={ip}"]
    cmd += [f"--main_process_port={port}", "--mixed_precision=no", "--dynamo_backend=no"]
    return cmd


def _children(pid: int) -> list[int]:
    """Every process below `pid` (the agent's workers, in sessions of their own)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = Path(f"/proc/{parent}/task/{parent}/children")
        try:
            pids = [int(p) for p in kids.read_text().split()]
        except OSError:
            pids = []
        found += pids
        todo += pids
    return found


def worker_logs(out_dir: Path, host: int, attempt: int) -> dict[int, str]:
    """Each local rank's stderr on emulated host `host` in attempt `attempt` (torchrun's
    `<log-dir>/<run id>/attempt_<n>/<local rank>/stderr.log`)."""
    found = {}
    for path in sorted((out_dir / f"agent{host}").glob(f"*/attempt_{attempt}/*/stderr.log")):
        found[int(path.parent.name)] = path.read_text()
    return found
