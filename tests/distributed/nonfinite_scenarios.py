"""Non-finite losses on 4 gloo ranks (pp 2 x dp_shard 2, the bundled GPT): where the NaN came
from, named on every rank, or the step skipped on every rank (`core.step.nonfinite`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from tests.distributed.common import MODEL, lm_loss, make_batches, make_model, make_optimizer

LAYOUT = {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 4}
BAD_STEP = 1


def cases(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Every case in one launch: a raise is the same on every rank, so the groups stay usable."""
    return {case.pop("id"): run(**case) for case in cases}


def run(cause: str, nonfinite: str = "raise", steps: int = 3) -> dict[str, Any]:
    """`steps` SGD steps; at step BAD_STEP a NaN enters through `cause`:
    "weights" (a weight of pipeline stage 1 turns NaN), "loss" (the loss function returns NaN)
    or "none"."""
    from lightning_zeropp import launch_layout
    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine

    step = 0

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(output, target)
        return loss * math.nan if cause == "loss" and step == BAD_STEP else loss

    config = ZeroPPConfig(**LAYOUT, nonfinite=nonfinite)
    example = (torch.zeros(2, MODEL.seq_len, dtype=torch.long),)
    engine = ZeroPPEngine(
        make_model(), launch_layout(config), loss_fn=loss_fn, example_args=example
    )
    opt = make_optimizer("sgd", engine.parameters())
    rows = slice(engine.dims.dp_rank * 8, engine.dims.dp_rank * 8 + 8)
    out: dict[str, Any] = {"losses": [], "error": None}
    try:
        for step, (x, y) in enumerate(make_batches(steps)):  # loss_fn reads `step`
            if cause == "weights" and step == BAD_STEP and 1 in engine.stage_ids:
                with torch.no_grad():
                    next(engine.module.parameters()).fill_(math.nan)
            out["losses"].append(float(engine.train_step(x[rows], target=y[rows])))
            opt.step()
            opt.zero_grad()
    except FloatingPointError as err:
        out["error"] = str(err)
    out["skipped"] = engine.nonfinite.skipped
    out["params"] = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in engine.module.named_parameters()
    }
    return out
