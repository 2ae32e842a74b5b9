"""Activation offload on gloo ranks: each case trained with its layout and again with offload
off, from the same model and batches, with what the memory report measured."""

from __future__ import annotations

from typing import Any

import torch

from lightning_zeropp import launch_layout
from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from tests.distributed.common import (
    GLOBAL_BATCH,
    MODEL,
    lm_loss,
    make_batches,
    make_model,
    make_optimizer,
)
from tests.distributed.core_scenarios import _full, _rows


def pairs(
    cases: list[dict[str, Any]], chunked: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Per case: {"on": run, "off": run} (the layout as given, and with offload off); the
    `chunked` cases' {"chunked": run, "whole": run} under "chunked" (`chunked_scenarios`), in the
    same launch."""
    from tests.distributed import chunked_scenarios

    out: dict[str, Any] = {"chunked": chunked_scenarios.pairs(chunked or [])}
    for case in cases:
        off = {**case["layout"], "offload_activations": False}
        out[case["id"]] = {"on": _run(case["layout"]), "off": _run(off)}
    return out


def _run(layout: dict[str, Any], steps: int = 2) -> dict[str, Any]:
    config = ZeroPPConfig(**layout).resolve(torch.distributed.get_world_size())
    micro = GLOBAL_BATCH // config.dp_size // config.num_microbatches
    example = (torch.zeros(micro, MODEL.seq_len, dtype=torch.long),)
    engine = ZeroPPEngine(
        make_model(), launch_layout(config), loss_fn=lm_loss, split="call", example_args=example
    )
    opt = make_optimizer("adamw", engine.parameters())
    losses = []
    for x, y in make_batches(steps, global_batch=GLOBAL_BATCH):
        rows = _rows(engine, GLOBAL_BATCH)
        losses.append(engine.train_step(x[rows], target=y[rows]).item())
        opt.step()
        opt.zero_grad()
    report = engine.memory_report([opt])
    stats = engine.offload
    return {
        "losses": losses,
        "params": {n: _full(p) for n, p in engine.module.named_parameters()},
        "pp_rank": engine.dims.pp_rank,
        "activation_peak": engine.activation_peak,
        "host_peak": engine.host_activation_peak,
        "moved": None if stats is None else stats.moved,
        "host_live": None if stats is None else stats.live,
        "storages": None if stats is None else stats.storages,
        "tensors": None if stats is None else stats.tensors,
        "fetched_ahead": None if stats is None else stats.fetched_ahead,
        "fetched_late": None if stats is None else stats.fetched_late,
        "report": report,
    }
