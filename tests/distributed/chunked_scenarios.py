"""The head and the loss in chunks on gloo ranks: each case trained with its `loss_chunk` and again
with whole logits (`loss_chunk=0`), from the same model (the bundled GPT with a large head: the
last stage computes `GPT(x, targets)`) and batches, with the activation peak the memory report
measured on each rank."""

from __future__ import annotations

from typing import Any

import torch

from lightning_zeropp import launch_layout
from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from lightning_zeropp.core._torch_private import set_compile_threads
from lightning_zeropp.core.shard.compile import compile_stats
from tests.distributed.common import (
    BIG_HEAD,
    GLOBAL_BATCH,
    make_batches,
    make_model,
    make_optimizer,
)
from tests.distributed.core_scenarios import _full, _rows

STEPS = 2


def pairs(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per case: {"chunked": run, "whole": run}."""
    return {
        case["id"]: {
            "chunked": _run(case["layout"]),
            "whole": _run({**case["layout"], "loss_chunk": 0}),
        }
        for case in cases
    }


def _the_loss(out: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
    return out  # the last stage's GPT(x, targets) is the loss


def _run(layout: dict[str, Any]) -> dict[str, Any]:
    config = ZeroPPConfig(**layout).resolve(torch.distributed.get_world_size())
    if config.compile:
        set_compile_threads(1)  # ranks share two cores: no pool of compile workers per rank
    compiled = compile_stats().get("split_runs", 0) + compile_stats().get("whole_runs", 0)
    micro = GLOBAL_BATCH // config.dp_size // config.num_microbatches
    ids = torch.zeros(micro, BIG_HEAD.seq_len, dtype=torch.long)
    engine = ZeroPPEngine(
        make_model(config=BIG_HEAD), launch_layout(config), loss_fn=_the_loss, split="call",
        example_args=(ids, ids),
    )  # fmt: skip
    opt = make_optimizer("adamw", engine.parameters())
    losses = []
    for x, y in make_batches(STEPS, global_batch=GLOBAL_BATCH):
        rows = _rows(engine, GLOBAL_BATCH)
        losses.append(engine.train_step(x[rows], y[rows], target=y[rows]).item())
        opt.step()
        opt.zero_grad()
    return {
        "losses": losses,
        "params": {n: _full(p) for n, p in engine.module.named_parameters()},
        "last": engine.last_pp_rank == engine.dims.pp_rank,
        "activation_peak": engine.activation_peak,
        # runs of compiled blocks in this case (compile_stats counts per process)
        "compiled": compile_stats().get("split_runs", 0)
        + compile_stats().get("whole_runs", 0)
        - compiled,
    }
