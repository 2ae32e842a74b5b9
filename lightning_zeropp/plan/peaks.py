"""Every rank's predicted peak memory, by kind: what the layout search (`plan.search`) checks
against each rank's budget.

`rank_memory` is the planner's model state, gathered weights and activations (with a
recomputing block's transient) plus the unsharded gradients FSDP holds until their
reduce-scatter (`gradient_buffers`) and what ZeRO++ holds (`plan.plus`: hpZ's copy, qgZ's
error feedback, the comms' buffers, counted from their code, not measured). Every other term
is checked against runs (tests/distributed/test_planner.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.settings.placement import schedule_style, stage_ids_for_rank
from lightning_zeropp.core.settings.plus import hpz_size
from lightning_zeropp.plan.activations import activation_peaks
from lightning_zeropp.plan.cut import settle
from lightning_zeropp.plan.memory import predict_memory, stage_parameter_shapes, stage_units
from lightning_zeropp.plan.plus import plus_memory
from lightning_zeropp.plan.programs import programs_for

__all__ = ["gradient_buffers", "rank_memory"]


def rank_memory(
    model: nn.Module,
    config: ZeroPPConfig | ZeroPPLayout,
    world_size: int,
    global_batch: int,
    seq_len: int,
    optimizer: str = "adamw",
    device_type: str = "cuda",
) -> list[dict[str, int]]:
    """Every rank's predicted peak bytes by kind, and their sum ("total"); a config without
    split points is priced as the engine cuts it at `seq_len` (`plan.cut.settle`)."""
    config = settle(model, config, seq_len, world_size)
    cfg = config.resolve(world_size)
    states = predict_memory(model, cfg, world_size, optimizer, device_type)
    acts = activation_peaks(model, cfg, world_size, global_batch, seq_len, device_type=device_type)
    grads = gradient_buffers(model, cfg)
    plus = _plus_bytes(model, cfg)
    out = []
    for plan in states:
        pp_rank = plan.rank // (cfg.dp_size * cfg.cp_size)
        entry = {
            "model_state": 0 if plan.on_host else plan.model_state,
            "gathered_weights": plan.gathered_peak,
            "activations": acts[pp_rank],
            "gradient_buffers": grads[pp_rank],
            "zeropp_plus": plus[pp_rank],
        }
        entry["total"] = sum(entry.values())
        out.append(entry)
    return out


def gradient_buffers(model: nn.Module, cfg: ZeroPPLayout) -> dict[int, int]:
    """Per pipeline rank, the most unsharded gradient bytes FSDP holds at once in a step (a
    resolved config): a stage's buffer lives from its first gradient task (B or W) until the
    reduce-scatter after its last one, or an early one (`programs_for` places them as the
    runtime does), in the reduce dtype."""
    reduce = cfg.reduce_dtype or (torch.float32 if cfg.param_dtype else None)
    shapes = stage_parameter_shapes(model, cfg)
    size = [sum(math.prod(s) * (_size(reduce) or b) for s, b in stage) for stage in shapes]
    out = {}
    for rank, program in programs_for(cfg).items():
        live: set[int] = set()
        peak = 0
        for op in program:
            if op.kind in "BW":
                live.add(op.stage)
                peak = max(peak, sum(size[s] for s in live))
            if op.reduce:
                live.discard(op.stage)
        out[rank] = peak
    return out


def _plus_bytes(model: nn.Module, cfg: ZeroPPLayout) -> dict[int, int]:
    """Per pipeline rank, what ZeRO++ holds (`plan.plus.plus_memory`): 0 without it."""
    if not (cfg.quantized_weights or cfg.quantized_gradients or hpz_size(cfg)):
        return dict.fromkeys(range(cfg.pp_size), 0)
    stages = stage_units(model, cfg)
    style = schedule_style(cfg.schedule)
    return {
        r: plus_memory(
            cfg,
            [
                u
                for s in stage_ids_for_rank(style, r, cfg.pp_size, cfg.num_chunks)
                for u in (stages[s].rest, *stages[s].blocks)
            ],
        )
        for r in range(cfg.pp_size)
    }


def _size(dtype: torch.dtype | None) -> int | None:
    return dtype.itemsize if dtype else None
