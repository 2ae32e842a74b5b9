"""Scenarios for one CUDA device (`test_gpu.py`): one rank, NCCL, every schedule's stages on it.

A lent machine has one GPU, and two ranks cannot share it under NCCL: a pipeline of pp_size 1
with two chunks (num_chunks=2) still runs every schedule's task order, split backward included,
on that rank. `device="cpu"` runs the same on gloo (a dry run without a GPU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_zeropp import launch_layout
from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from lightning_zeropp.core.shard.compile import compile_stats
from tests.distributed.common import MODEL, lm_loss, make_batches, make_model, make_optimizer


def compile_parity(device: str, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Train each case eager and compiled on `device`; losses, parameters and compile counters."""
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: 1e-5 against the CPU
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("cuda:nccl,cpu:gloo" if device == "cuda" else "gloo")
    out = {}
    for case in cases:
        for compiled in (False, True):
            before = compile_stats()
            result = _train(torch.device(device), {**case["layout"], "compile": compiled})
            result["compile"] = {k: v - before.get(k, 0) for k, v in compile_stats().items()}
            out[(case["id"], compiled)] = result
    dist.destroy_process_group()
    return out


def _train(device: torch.device, layout: dict[str, Any], steps: int = 3) -> dict[str, Any]:
    config = ZeroPPConfig(**layout).resolve(dist.get_world_size())
    micro = 16 // config.num_microbatches
    example = (torch.zeros(micro, MODEL.seq_len, dtype=torch.long, device=device),)
    engine = ZeroPPEngine(
        make_model(),
        launch_layout(config),
        loss_fn=lm_loss,
        split="call",
        example_args=example,
        device=device,
    )
    opt = make_optimizer("adamw", engine.parameters())
    losses = []
    for x, y in make_batches(steps):
        losses.append(float(engine.train_step(x.to(device), target=y.to(device))))
        opt.step()
        opt.zero_grad()
    params = {n: _full(p).cpu() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "params": params}


def _full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
