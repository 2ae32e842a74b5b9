"""Scenarios running `clm_loop.train` under `ZeroPPAccelerator`, plain DDP and one process."""

from __future__ import annotations

import datetime
from dataclasses import replace
from typing import Any

from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from lightning_zeropp.accelerate import ZeroPPAccelerator, ZeroPPPlugin
from tests.distributed.clm_loop import Args, train

PG = [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=120))]


def run(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Each case: {"id", "args": Args fields, "plugin": ZeroPPPlugin settings or None (plain
    Accelerator), "save_to": optional}."""
    out = {}
    for case in cases:
        args = replace(Args(), **case.get("args", {}))
        acc_kwargs = {"cpu": True, "kwargs_handlers": PG}
        acc_kwargs["gradient_accumulation_steps"] = args.gradient_accumulation_steps
        if case.get("plugin") is None:
            accelerator = Accelerator(**acc_kwargs)
        else:
            plugin = ZeroPPPlugin(**case["plugin"])
            accelerator = ZeroPPAccelerator(zeropp_plugin=plugin, **acc_kwargs)
        out[case["id"]] = train(accelerator, args, case.get("save_to"))
        accelerator.free_memory()
    return out


def resume(plugin: dict[str, Any], save_to: str, export_to: str) -> dict[str, Any]:
    """4 updates straight (and run_clm's export), against 2 updates + save_state + a run from
    other initial weights that loads the state and trains the last 2."""
    base = {"eval_rows": 10, "export_to": export_to}
    full = run([{"id": "full", "plugin": plugin, "args": base}])["full"]
    first = run([{"id": "first", "plugin": plugin, "args": {"stop_after": 2}, "save_to": save_to}])
    again = {"resume_from": save_to, "resumed_updates": 2, "init_seed": 7}
    resumed = run([{"id": "resumed", "plugin": plugin, "args": again}])["resumed"]
    return {"full": full, "first": first["first"], "resumed": resumed}
