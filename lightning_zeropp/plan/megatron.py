"""Megatron-style 3D parallelism (tensor x pipeline x data), priced like the layouts this library
runs, so that comparisons with the ZeroPP paper are like for like. The library does not run TP;
this module only predicts it.

Assumptions (Megatron-LM's usual large-model settings; each is a choice, stated):
- tensor parallelism over `tp` ranks inside a node, with sequence parallelism: per block and
  micro-batch, 2 all-gathers and 2 reduce-scatters of the block's input activation in forward and
  the same in backward, on the critical path (no TP communication overlap); compute is the
  block's FLOPs divided by `tp` at the same sustained rate as unsplit matmuls (optimistic for TP:
  its smaller matmuls run less efficiently);
- pipeline over `pp` ranks with torch's 1F1B or interleaved 1F1B order (`num_chunks`), messages of
  the activation split over `tp` (sequence parallel);
- data parallelism over the rest with the distributed optimizer: gradients reduce-scattered in
  fp32 and parameters all-gathered in bf16 over `dp` ranks (across nodes when `tp` fills a node),
  both overlapped with compute except what the comm lane cannot hide (`plan.simulate`);
- memory per rank: bf16 weights and fp32 gradients of its 1/(tp x pp) of the model, fp32 master
  weights and AdamW moments sharded over dp (12 bytes a parameter / dp), activations as the
  planner counts them for the unsplit block, divided by `tp` (sequence parallelism shards them
  all), replayed over the schedule's in-flight micro-batches; full recomputation keeps each
  block's input only;
- the head and the loss as Megatron computes them: the logits split over `tp` by vocabulary
  (its vocab-parallel cross-entropy), each rank's share whole, not in chunks (the library's
  `loss_chunk` is not Megatron's), so the last stage keeps 1/tp of a micro-batch's logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.settings.placement import (
    rank_of_stage,
    schedule_style,
    stage_ids_for_rank,
)
from lightning_zeropp.core.split.blocks import find_blocks
from lightning_zeropp.plan.hardware import Hardware
from lightning_zeropp.plan.memory import stage_ranges
from lightning_zeropp.plan.orders import task_orders
from lightning_zeropp.plan.profile import ModelProfile, micro_batch_rows, profile_model
from lightning_zeropp.plan.programs import programs_for
from lightning_zeropp.plan.simulate import StageCost, simulate

__all__ = ["ThreeD", "predict_3d"]


@dataclass(frozen=True)
class ThreeD:
    """A Megatron-style layout and what the model predicts for it."""

    tp: int
    pp: int
    dp: int
    num_chunks: int
    num_microbatches: int
    recompute: bool
    step_s: float
    memory_bytes: int  # the busiest rank's
    mfu: float


def predict_3d(
    model: nn.Module,
    world_size: int,
    global_batch: int,
    seq_len: int,
    hardware: Hardware,
    *,
    tp: int = 8,
    pp: int = 1,
    num_chunks: int = 1,
    num_microbatches: int | None = None,
    recompute: bool = False,
) -> ThreeD:
    """Predict one bf16 AdamW step of `model` (meta device) under TP x PP x DP."""
    if world_size % (tp * pp):
        raise ValueError(f"tp {tp} x pp {pp} does not divide a world of {world_size}")
    if hardware.dtype not in (None, "bf16", "fp16"):
        raise ValueError(
            f"the 3D model prices bf16 compute; hardware is priced for {hardware.dtype}"
        )
    dp = world_size // (tp * pp)
    m = num_microbatches or pp
    rows = micro_batch_rows(global_batch, dp, m)
    schedule = "interleaved_1f1b" if num_chunks > 1 else "1f1b"
    cfg = ZeroPPConfig(
        pp_size=pp, dp_shard_size=1, num_chunks=num_chunks if num_chunks > 1 else None,
        num_microbatches=m, schedule=schedule, reshard_after_forward=False, node_size=pp,
    ).resolve(pp)  # fmt: skip
    profile = profile_model(model, rows, seq_len, torch.bfloat16)
    container, names = find_blocks(model)
    holder = model.get_submodule(container) if container else model
    block_params = [sum(p.numel() for p in holder.get_submodule(n).parameters()) for n in names]
    total_params = sum(p.numel() for p in model.parameters())
    root_params = total_params - sum(block_params)
    ranges = stage_ranges(model, cfg)
    rate = hardware.flops_per_s
    act_bytes = profile.blocks[0].output  # one block's input: b x s x h in bf16
    intra = hardware.link(0, tp - 1)
    tp_pass = 4 * (tp - 1) / tp * act_bytes / intra + 4 * (tp - 1) * hardware.latency_s
    costs, stage_params, stage_saved = [], [], []
    style = schedule_style(schedule)
    for s, blocks in enumerate(ranges):
        first, last = s == 0, s == cfg.num_stages - 1
        part = profile.stage(blocks, first, last, recompute)
        params = sum(block_params[i] for i in blocks) + (root_params // 2 if first or last else 0)
        own = (profile.before.flops if first else 0.0) + (profile.after.flops if last else 0.0)
        compute = [own / tp / rate, *(profile.blocks[i].flops / tp / rate for i in blocks)]
        comm = [0.0, *([tp_pass if tp > 1 else 0.0] * len(blocks))]
        forward = [c + x for c, x in zip(compute, comm, strict=True)]
        backward = [2 * c + x for c, x in zip(compute, comm, strict=True)]  # TP collectives again
        # distributed optimizer: fp32 grads reduce-scattered, bf16 params all-gathered, per unit
        units = [root_params // 2 if first or last else 0, *(block_params[i] for i in blocks)]
        dp_link = hardware.link(0, world_size - 1) if dp > 1 else intra
        lat = hardware.latency_s * (dp - 1)
        gather = tuple(lat + (dp - 1) / dp * n / tp * 2 / dp_link if dp > 1 else 0.0 for n in units)
        reduce = tuple(lat + (dp - 1) / dp * n / tp * 4 / dp_link if dp > 1 else 0.0 for n in units)
        nxt = rank_of_stage(style, min(s + 1, cfg.num_stages - 1), pp)
        hop = hardware.link(rank_of_stage(style, s, pp) * tp * dp, nxt * tp * dp)
        costs.append(
            StageCost(
                forward=tuple(forward), backward=tuple(backward), gather=gather, reduce=reduce,
                send=hardware.latency_s + part.output / tp / hop, recompute=recompute,
            )
        )  # fmt: skip
        stage_params.append(params)
        stage_saved.append(part.saved / tp)
    where = {s: rank_of_stage(style, s, pp) for s in range(cfg.num_stages)}
    lines = simulate(programs_for(cfg), costs, where, overlap=True)
    memory = _memory(cfg, stage_params, stage_saved, tp, dp, profile, recompute)
    opt = max(
        sum(stage_params[i] for i in stage_ids_for_rank(style, r, pp, cfg.num_chunks))
        for r in range(pp)
    ) / tp / dp * 16 / hardware.memory_Bps  # fmt: skip
    step = max(line.end for line in lines.values()) + opt
    model_flops = 3 * (
        profile.before.flops + sum(b.flops for b in profile.blocks) + profile.after.flops
    ) * m * dp  # fmt: skip
    peak = hardware.peak_flops_per_s or hardware.flops_per_s
    return ThreeD(tp, pp, dp, cfg.num_chunks, m, recompute, step, memory,
                  model_flops / (step * world_size * peak))  # fmt: skip


def _memory(
    cfg: ZeroPPLayout,
    stage_params: list[int],
    stage_saved: list[float],
    tp: int,
    dp: int,
    profile: ModelProfile,
    recompute: bool,
) -> int:
    style = schedule_style(cfg.schedule)
    worst = 0
    for rank, order in task_orders(cfg).items():
        ids = stage_ids_for_rank(style, rank, cfg.pp_size, cfg.num_chunks)
        params = sum(stage_params[i] for i in ids) / tp
        state = params * (2 + 4) + params * 12 / dp  # bf16 weights, fp32 grads; sharded optimizer
        live = peak = 0.0
        for kind, stage, _ in order:
            live += stage_saved[stage] if kind == "F" else 0.0
            peak = max(peak, live)
            live -= stage_saved[stage] if kind in "BW" else 0.0
        if recompute:  # one block's activations exist again while it runs backward
            peak += max(b.saved for b in profile.blocks) / tp
        worst = max(worst, int(state + peak))
    return worst
