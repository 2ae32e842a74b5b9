"""Scenarios for CommCounter on gloo ranks: what a train step of the engine sends, by mesh axis."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from lightning_zeropp import launch_layout
from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from lightning_zeropp.core.measure.axes import mesh_axis_namer
from lightning_zeropp.core.measure.comm import CommCounter
from lightning_zeropp.models import GPT, GPTConfig

# An odd vocabulary makes FSDP2 pad the embedding's and the head's dim-0 shards.
MODEL = GPTConfig(vocab_size=63, seq_len=16, dim=32, num_heads=2, num_layers=4)
GLOBAL_BATCH = 16


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def engine_step(layout: dict[str, Any]) -> dict[str, Any]:
    """One uncounted step (the runtime's first step also infers shapes), then one counted step."""
    config = ZeroPPConfig(**layout).resolve(dist.get_world_size())
    micro = GLOBAL_BATCH // config.dp_size // config.num_microbatches
    example = (torch.zeros(micro, MODEL.seq_len, dtype=torch.long),)
    torch.manual_seed(0)
    engine = ZeroPPEngine(GPT(MODEL), launch_layout(config), loss_fn=_loss, example_args=example)
    per_rank = GLOBAL_BATCH // config.dp_size
    rows = slice(engine.dims.dp_rank * per_rank, (engine.dims.dp_rank + 1) * per_rank)
    g = torch.Generator().manual_seed(1)
    x0, y0, x1, y1 = (
        torch.randint(0, MODEL.vocab_size, (GLOBAL_BATCH, MODEL.seq_len), generator=g)
        for _ in range(4)
    )
    engine.train_step(x0[rows], target=y0[rows])
    with CommCounter(mesh_axis_namer(engine.dims.mesh)) as comm:
        engine.train_step(x1[rows], target=y1[rows])
    return {
        "summary": comm.summary(),
        "units": _fsdp_units(engine.module),
        "stage_ids": engine.stage_ids,
        "activation_shape": (micro, MODEL.seq_len, MODEL.dim),
    }


def _fsdp_units(root: torch.nn.Module) -> list[list[tuple[int, ...]]]:
    """Global shapes of the parameters each FSDP unit owns (not those of nested units)."""
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    owned = []
    for unit in units:
        nested = {
            id(p) for u in units if u is not unit and _inside(u, unit) for p in u.parameters()
        }
        owned.append([tuple(p.shape) for p in unit.parameters() if id(p) not in nested])
    return owned


def _inside(inner: torch.nn.Module, outer: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def batch_p2p() -> dict[str, Any]:
    """Rank 0 and 1 swap tensors through batch_isend_irecv, one op built before counting starts."""
    peer = 1 - dist.get_rank()
    early = dist.P2POp(dist.isend, torch.ones(3), peer)  # holds the unpatched isend
    with CommCounter() as comm:
        ops = [
            early,
            dist.P2POp(dist.isend, torch.ones(5, dtype=torch.float64), peer),
            dist.P2POp(dist.irecv, torch.empty(3), peer),
            dist.P2POp(dist.irecv, torch.empty(5, dtype=torch.float64), peer),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return {"summary": comm.summary(), "received": [op.tensor.tolist() for op in ops[2:]]}
