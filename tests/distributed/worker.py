"""Entry point of one rank: `python -m tests.distributed.worker SCENARIO PARAMS_JSON OUT_DIR`."""

from __future__ import annotations

import os
from pathlib import Path

from tests.distributed.cgroup import join_memory_cgroup

# Before torch is imported: everything this process allocates counts against its cap.
if __name__ == "__main__" and os.environ.get("LZPP_TESTS_MEMORY_CAP"):
    join_memory_cgroup(int(os.environ["LZPP_TESTS_MEMORY_CAP"]))

import datetime  # noqa: E402
import faulthandler  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    # The launcher sends SIGUSR1 before it kills a rank that ran past its time: every thread's
    # stack goes to the rank's log, so a hang says where it hung.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # A rank that dies of a signal (SIGSEGV, SIGABRT: seen once, a rank exiting -11 in a gloo
    # collective) leaves its threads' Python stacks in its log too.
    faulthandler.enable(all_threads=True)
    scenario, params, out_dir = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    module_name, _, fn_name = scenario.rpartition(".")
    fn = getattr(importlib.import_module(f"tests.distributed.{module_name}"), fn_name)
    torch.set_num_threads(1)
    if params.pop("init_process_group", True):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = int(os.environ["RANK"])
    if os.environ.get("LZPP_TESTS_PROFILE") == "1":  # where a launch spends its CPU time
        import cProfile
        import time

        profile = cProfile.Profile(time.process_time)
        result = profile.runcall(fn, **params)
        profile.dump_stats(out_dir / f"profile{rank}.prof")
    else:
        result = fn(**params)
    torch.save(result, out_dir / f"result{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
