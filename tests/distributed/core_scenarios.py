"""Scenarios run on gloo ranks against the core engine (no Lightning)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_zeropp import launch_layout
from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from lightning_zeropp.core.measure.axes import mesh_axis_namer
from lightning_zeropp.core.measure.comm import CommCounter
from tests.distributed.common import (
    BIG_HEAD,
    GLOBAL_BATCH,
    MAX_NORM,
    MODEL,
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
    split: str = "call",
    global_batch: int = GLOBAL_BATCH,
    count_comms: bool = False,
    model: str = "gpt",
) -> dict[str, Any]:
    config = ZeroPPConfig(**layout).resolve(torch.distributed.get_world_size())
    micro = global_batch // config.dp_size // config.num_microbatches
    example = (torch.zeros(micro, MODEL.seq_len, dtype=torch.long),)
    method = _stage_builder if split == "callable" else split
    net = make_model(config=BIG_HEAD) if model == "big_head" else make_model()
    engine = ZeroPPEngine(
        net, launch_layout(config), loss_fn=lm_loss, split=method, example_args=example
    )
    opt = make_optimizer(optimizer, engine.parameters())
    losses, norms, comms = [], [], []
    for x, y in make_batches(steps, global_batch=global_batch):
        rows = _rows(engine, global_batch)
        with CommCounter(mesh_axis_namer(engine.dims.mesh)) if count_comms else nullcontext() as c:
            loss = engine.train_step(x[rows], target=y[rows])
        comms.append(c.summary() if count_comms else None)
        if clip:
            norms.append(float(engine.clip_grad_norm_(MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    params = {n: _full(p) for n, p in engine.module.named_parameters()}
    return {
        "losses": losses,
        "norms": norms,
        "params": params,
        "comms": comms,
        "plan": _plan(engine),
        "stage_starts": [r.start for r in engine.plan.ranges] if engine.plan else None,
    }


def _plan(engine: ZeroPPEngine) -> dict[int, int]:
    """FSDP units that own parameters, per local stage: what one gather of the stage all-gathers."""
    from torch.distributed.fsdp import FSDPModule

    def owns_params(unit: torch.nn.Module) -> bool:
        nested = {
            id(p)
            for m in unit.modules()
            if m is not unit and isinstance(m, FSDPModule)
            for p in m.parameters()
        }
        return any(id(p) not in nested for p in unit.parameters())

    return {
        stage.stage_index: sum(
            1 for m in stage.submod.modules() if isinstance(m, FSDPModule) and owns_params(m)
        )
        for stage in engine.stages
    }


class _Stage(torch.nn.Module):
    """A hand-written stage: the documented hook for models neither traceable nor stack-shaped."""

    def __init__(self, model: torch.nn.Module, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.blocks = torch.nn.ModuleList()
        self.blocks._modules = {str(i): model.blocks[i] for i in blocks}  # original names
        if last:
            self.norm, self.head = model.norm, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1])
            x = self.tok_emb(x) * (self.tok_emb.embedding_dim**0.5) * 0.1 + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) if self.last else x


def _stage_builder(model, stage: int, num_stages: int, ranges: list[range]) -> torch.nn.Module:
    return _Stage(model, ranges[stage], stage == 0, stage == num_stages - 1)


def _rows(engine: ZeroPPEngine, global_batch: int) -> slice:
    per_rank = global_batch // engine.dims.dp_size
    start = engine.dims.dp_rank * per_rank
    return slice(start, start + per_rank)


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
