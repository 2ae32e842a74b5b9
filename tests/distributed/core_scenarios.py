"""Scenarios run on gloo ranks against the core engine (no Lightning)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from tests.distributed.common import (
    GLOBAL_BATCH,
    MAX_NORM,
    lm_loss,
    make_batches,
    make_model,
    make_optimizer,
)


def parity(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Train every case for a few steps; return per-case losses, norms and full parameters."""
    return {case["id"]: _train(**case) for case in cases}


def _train(
    id: str,
    layout: dict[str, Any],
    optimizer: str = "sgd",
    clip: bool = False,
    steps: int = 3,
    split: str = "trace",
) -> dict[str, Any]:
    config = ZeroPPConfig(**layout).resolve(torch.distributed.get_world_size())
    micro = GLOBAL_BATCH // config.dp_size // config.num_microbatches
    example = (torch.zeros(micro, make_batches(1)[0][0].shape[1], dtype=torch.long),)
    engine = ZeroPPEngine(make_model(), config, loss_fn=lm_loss, split=split, example_args=example)
    opt = make_optimizer(optimizer, engine.parameters())
    losses, norms = [], []
    for x, y in make_batches(steps):
        rows = _rows(engine)
        loss = engine.train_step(x[rows], target=y[rows])
        if clip:
            norms.append(float(engine.clip_grad_norm_(MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    params = {n: _full(p) for n, p in engine.module.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}


def _rows(engine: ZeroPPEngine) -> slice:
    per_rank = GLOBAL_BATCH // engine.dims.dp_size
    start = engine.dims.dp_rank * per_rank
    return slice(start, start + per_rank)


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
