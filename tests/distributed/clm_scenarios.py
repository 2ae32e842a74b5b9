"""Scenarios running `clm_loop.train` under `ZeroPPAccelerator`, plain DDP and one process."""

from __future__ import annotations

import datetime
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from torch.utils.data import DataLoader

from lightning_zeropp.accelerate import ZeroPPAccelerator, ZeroPPPlugin
from tests.distributed.clm_loop import Args, Texts, build_model, collate, train

PG = [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=120))]


def run(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Each case: {"id", "args": Args fields, "plugin": ZeroPPPlugin settings or None (plain
    Accelerator), "save_to": optional, "tied_gap": record `tied_gap` after every update,
    "catch": report an error as {"error": ...} instead of raising (one case per launch)}."""
    out = {}
    for case in cases:
        if case.get("catch"):
            try:
                out.update(run([{**case, "catch": False}]))
            except Exception as err:  # the benchmark's table reports it
                out[case["id"]] = {"error": f"{type(err).__name__}: {err}"}
            continue
        args = replace(Args(), **case.get("args", {}))
        acc_kwargs = {"cpu": True, "kwargs_handlers": PG}
        acc_kwargs["gradient_accumulation_steps"] = args.gradient_accumulation_steps
        if case.get("plugin") is None:
            accelerator = Accelerator(**acc_kwargs)
        else:
            plugin = ZeroPPPlugin(**case["plugin"])
            accelerator = ZeroPPAccelerator(zeropp_plugin=plugin, **acc_kwargs)
        probe = tied_gap if case.get("tied_gap") else None
        start = time.monotonic()
        out[case["id"]] = train(accelerator, args, case.get("save_to"), probe)
        out[case["id"]]["seconds"] = time.monotonic() - start
        accelerator.free_memory()
    return out


def tied_gap(model: Any) -> float:
    """Collective: the largest difference between the copies of any tied weight, over every
    rank's stages (0.0 when they are equal; one process holds one tensor)."""
    import torch.distributed as dist

    if not hasattr(model, "engine") or not dist.is_initialized():
        return 0.0
    return copies_gap(tied_names(model.original), model.engine.module)


def tied_names(model: Any) -> list[list[str]]:
    """The names of each tensor `model` holds under several names."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def copies_gap(tied: list[list[str]], stages: Any) -> float:
    """Collective: the largest difference between the per-stage copies of each name group."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    mine = dict(stages.named_parameters(remove_duplicate=False))
    local = {}
    for names in tied:
        for name in names:
            if name in mine:  # every data-parallel peer walks the same names: gathers line up
                p = mine[name]
                local[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    gap = 0.0
    for names in tied:
        copies = [part[n] for part in everyone for n in names if n in part]
        gap = max([gap, *(float((c - copies[0]).abs().max()) for c in copies[1:])])
    return gap


def resume(plugin: dict[str, Any], save_to: str, export_to: str) -> dict[str, Any]:
    """4 updates straight (and run_clm's export), against 2 updates + save_state + a run from
    other initial weights that loads the state and trains the last 2."""
    base = {"eval_rows": 10, "export_to": export_to}
    full = run([{"id": "full", "plugin": plugin, "args": base}])["full"]
    first = run([{"id": "first", "plugin": plugin, "args": {"stop_after": 2}, "save_to": save_to}])
    again = {"resume_from": save_to, "resumed_updates": 2, "init_seed": 7}
    resumed = run([{"id": "resumed", "plugin": plugin, "args": again}])["resumed"]
    automatic = automatic_naming(plugin, str(Path(save_to).parent / "project"))
    return {"full": full, "first": first["first"], "resumed": resumed, "automatic": automatic}


def automatic_naming(plugin: dict[str, Any], project_dir: str) -> dict[str, Any]:
    """save_state() three times under automatic naming with total_limit=2, then load_state()
    (Accelerate picks the newest folder) into other weights."""
    import torch
    from accelerate.utils import ProjectConfiguration
    from torch.distributed.tensor import DTensor

    project = ProjectConfiguration(project_dir, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = ZeroPPAccelerator(
        zeropp_plugin=ZeroPPPlugin(**plugin),
        cpu=True,
        kwargs_handlers=PG,
        project_config=project,
    )
    model = build_model(Args())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(Texts(16, 0), batch_size=2, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    first = next(p for p in model.parameters())
    for _ in range(3):
        with torch.no_grad():
            first.add_(1.0)  # each save holds other weights
        accelerator.save_state()
    saved = first.full_tensor() if isinstance(first, DTensor) else first.detach().clone()
    listing = sorted(p.name for p in (Path(project_dir) / "checkpoints").iterdir())
    with torch.no_grad():
        first.zero_()
    accelerator.load_state()
    loaded = first.full_tensor() if isinstance(first, DTensor) else first.detach().clone()
    return {"listing": listing, "equal": bool(torch.equal(saved, loaded)), "project": project_dir}
