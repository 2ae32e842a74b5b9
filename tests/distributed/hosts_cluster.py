"""Ranks on emulated hosts: each rank in a UTS namespace of its own host name (`unshare --uts`),
optionally inside one network namespace per host with a data link (the backend's, which a test
may cut) and a control link (the store's), so ranks can be numbered across hosts as launchers
number them (SLURM's cyclic distribution) on one machine. Needs root; `unavailable()` says why
not. Every namespace is deleted on exit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Self

import torch

from tests.distributed.launch import ROOT, _kill, _tails, free_port

__all__ = ["TwoLinks", "launch_on_hosts", "unavailable"]


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (UTS and network namespaces)"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    done = subprocess.run(["unshare", "--uts", "hostname", "lzppprobe"], capture_output=True)
    return None if done.returncode == 0 else f"unshare --uts failed: {done.stderr.decode()}"


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class TwoLinks:
    """Hosts as network namespaces joined pairwise by two veth pairs: data (10.97.0.x, what gloo
    binds) and control (10.96.0.x, where the store listens). Two hosts."""

    def __init__(self) -> None:
        self.tag = str(os.getpid() % 100000)
        self.made: list[str] = []

    def ns(self, host: int) -> str:
        return f"lzpph{self.tag}n{host}"

    def data_dev(self, host: int) -> str:
        return f"d{self.tag}n{host}"

    def data_address(self, host: int) -> str:
        return f"10.97.0.{host + 1}"

    def control_address(self, host: int) -> str:
        return f"10.96.0.{host + 1}"

    def __enter__(self) -> Self:
        try:
            for host in (0, 1):
                _ip("netns", "add", self.ns(host))
                self.made.append(self.ns(host))
                _ip("-n", self.ns(host), "link", "set", "lo", "up")
            for kind, address in (("d", self.data_address), ("c", self.control_address)):
                a, b = f"{kind}{self.tag}n0", f"{kind}{self.tag}n1"
                _ip("link", "add", a, "type", "veth", "peer", "name", b)
                for host, dev in ((0, a), (1, b)):
                    _ip("link", "set", dev, "netns", self.ns(host))
                    _ip("-n", self.ns(host), "addr", "add", f"{address(host)}/24", "dev", dev)
                    _ip("-n", self.ns(host), "link", "set", dev, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.made.clear()


def launch_on_hosts(
    host_of_rank: list[int],
    scenario: str,
    params: dict[str, Any],
    out_dir: Path,
    timeout: float = 300.0,
    names: tuple[str, ...] = ("nodeA", "nodeB"),
    links: TwoLinks | None = None,
    extra_env: dict[int, dict[str, str]] | None = None,
    launcher: str = "torchrun",
) -> list[Any]:
    """Start rank r of `tests.distributed.worker` on host `host_of_rank[r]` (a fresh process in
    a UTS namespace named `names[host]`, inside `links`' namespace of that host if given), with
    the variables `launcher` ("torchrun" or "slurm": srun's, one task per device) sets for that
    numbering; return each rank's result."""
    out_dir.mkdir(parents=True, exist_ok=True)
    world, port = len(host_of_rank), free_port()
    procs, logs = [], []
    for rank, host in enumerate(host_of_rank):
        (out_dir / f"result{rank}.pt").unlink(missing_ok=True)
        mates = [r for r, h in enumerate(host_of_rank) if h == host]
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(mates.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(mates)),
            "GROUP_RANK": str(host),
            "NODE_RANK": str(host),
            "MASTER_ADDR": "127.0.0.1" if links is None else links.control_address(0),
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
            **({"GLOO_SOCKET_IFNAME": links.data_dev(host)} if links else {}),
            **(_slurm(host_of_rank, rank) if launcher == "slurm" else {}),
            **(extra_env or {}).get(rank, {}),
        }
        if (
            launcher == "slurm"
        ):  # srun sets none of torchrun's (the worker names its result by RANK)
            for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK"):
                env.pop(name)
        worker = [sys.executable, "-m", "tests.distributed.worker", scenario]
        worker += [json.dumps(params), str(out_dir)]
        inner = f'hostname {names[host]} && exec "$@"'
        cmd = ["unshare", "--uts", "sh", "-c", inner, "sh", *worker]
        if links is not None:
            cmd = ["ip", "netns", "exec", links.ns(host), *cmd]
        log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{scenario} ran past {timeout:.0f}s\n{_tails(out_dir, world, 60)}"
                )
            time.sleep(0.2)
    finally:
        _kill(procs)
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    if any(codes):
        raise AssertionError(f"ranks exited with {codes}\n{_tails(out_dir, world)}")
    return [torch.load(out_dir / f"result{r}.pt", weights_only=False) for r in range(world)]


def _slurm(host_of_rank: list[int], rank: int) -> dict[str, str]:
    """What `srun --ntasks-per-node=N` sets for task `rank` (the variables Lightning's
    SLURMEnvironment reads)."""
    host = host_of_rank[rank]
    mates = [r for r, h in enumerate(host_of_rank) if h == host]
    return {
        "SLURM_NTASKS": str(len(host_of_rank)),
        "SLURM_NTASKS_PER_NODE": str(len(mates)),
        "SLURM_NNODES": str(len(set(host_of_rank))),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(mates.index(rank)),
        "SLURM_NODEID": str(host),
        "SLURM_JOB_NAME": "zeropp",
        "SLURM_JOB_ID": "4242",
    }
