"""Activations per rank under context parallelism, measured beside the planner's figure: the
bundled GPT at a long sequence, one sequence per data-parallel group, at cp 1, 2 and 4 on the
same 4 ranks (cp 1: dp_shard 4; cp 2: dp_shard 2 x cp 2; cp 4), each rank holding one row's
worth of its part."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_zeropp import launch_layout
from lightning_zeropp.core.engine import ZeroPPEngine
from lightning_zeropp.core.measure.memory import SavedActivations
from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.models import GPT, GPTConfig
from lightning_zeropp.plan.peaks import rank_memory


def model_config(length: int) -> GPTConfig:
    return GPTConfig(vocab_size=128, seq_len=length, dim=256, num_heads=2, num_layers=2)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _measure(cp: int, length: int) -> dict[str, int]:
    world = dist.get_world_size()
    config = ZeroPPConfig(pp_size=1, dp_shard_size=world // cp, cp_size=cp, num_microbatches=1)
    cfg = model_config(length)
    torch.manual_seed(0)
    engine = ZeroPPEngine(GPT(cfg), launch_layout(config), loss_fn=_loss, split="stack")
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (1, length), generator=g)  # this data group's row
    engine.train_step(x, target=x)  # the first step runs the pipeline's setup too
    with SavedActivations() as saved:
        engine.train_step(x, target=x)
    with torch.device("meta"):
        meta = GPT(cfg)
    planned = rank_memory(meta, config, world, world // cp, length, device_type="cpu")
    return {"measured": saved.peak, "planner": planned[dist.get_rank()]["activations"]}


def run(length: int, cps: list[int]) -> dict[str, Any]:
    return {str(cp): _measure(cp, length) for cp in cps}
