"""A memory cgroup per rank (cgroup v1, root): imports nothing heavy, so a process can join its
group before it imports torch and the cap covers all it allocates. Used by the test worker
(`launch(memory_cap=...)`) and by `bench/bench_meta_memory.py`."""

from __future__ import annotations

import os
from pathlib import Path

MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory")  # cgroup v1's memory controller


def memory_cgroup(rank: int | str) -> Path:
    return MEMORY_CGROUPS / f"lzpp_tests_rank{rank}"


def join_memory_cgroup(cap: int) -> None:
    """Put this process in its rank's memory cgroup, limited to `cap` bytes (peak reset)."""
    group = memory_cgroup(os.environ["RANK"])
    group.mkdir(exist_ok=True)
    (group / "memory.limit_in_bytes").write_text(str(cap))
    (group / "cgroup.procs").write_text(str(os.getpid()))
    (group / "memory.max_usage_in_bytes").write_text("0")
