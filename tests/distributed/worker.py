"""Entry point of one rank: `python -m tests.distributed.worker SCENARIO PARAMS_JSON OUT_DIR`."""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    # The launcher sends SIGUSR1 before it kills a rank that ran past its time: every thread's
    # stack goes to the rank's log, so a hang says where it hung.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    scenario, params, out_dir = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    module_name, _, fn_name = scenario.rpartition(".")
    fn = getattr(importlib.import_module(f"tests.distributed.{module_name}"), fn_name)
    torch.set_num_threads(1)
    if params.pop("init_process_group", True):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    result = fn(**params)
    rank = int(os.environ["RANK"])
    torch.save(result, out_dir / f"result{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
