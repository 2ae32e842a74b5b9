"""What one micro-batch costs each stage of a layout (`plan.simulate.StageCost`), the step-time
model's inputs (`plan.steptime` simulates the schedule over them): FLOPs and bytes from the model
on the meta device, rates from `Hardware`.

- Compute: each stage's forward FLOPs per FSDP unit (`plan.profile`: torch's `FlopCounterMode`
  on meta tensors, the loss on the last stage), a backward twice its forward (exact for the matmuls that
  dominate), plus the forward again where a stage recomputes, and the head's forward again where
  the loss is computed in chunks (`plan.loss_chunk`); seconds = FLOPs / rate. Measured
  per-stage seconds (`stage_seconds`) may replace the rate, split over units by their FLOPs.
- Collectives: ring all-gathers and reduce-scatters over `dp_shard` of each unit's padded shard
  ((k - 1) hops of latency plus a shard each), HSDP's all-reduce over `dp_replicate`, and stage
  boundaries as one message each way; a group spanning nodes runs at the cross-node rate.
- Context parallelism (`plan.context`): one CP rank's FLOPs (its part of every sequence, its
  queries against all keys), each block's K/V all-gathers and gradient reduce-scatters over the
  CP group added to its forward and backward (exposed: the runtime waits for them), and FSDP's
  collectives over dp_shard x cp.
- Offloaded activations (`core.shard.offload`): the copies over the host link, where the compute
  does not hide them.
- ZeRO++ (`plan.plus`): qwZ's packed gathers, hpZ's backward gathers of the in-node copy (the
  programs mark which gathers read it), qgZ's two all-to-alls in place of the reduce-scatter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.settings.placement import rank_of_stage, schedule_style
from lightning_zeropp.core.settings.plus import hpz_size
from lightning_zeropp.plan.activations import stage_parts
from lightning_zeropp.plan.comm import padded_shard
from lightning_zeropp.plan.context import fsdp_view, kv_traffic, rank_profile
from lightning_zeropp.plan.hardware import SPLIT_BACKWARD, Hardware
from lightning_zeropp.plan.loss_chunk import head_recompute_flops, priced_chunk
from lightning_zeropp.plan.memory import StageUnits, stage_ranges, stage_units
from lightning_zeropp.plan.plus import unit_traffic
from lightning_zeropp.plan.profile import micro_batch_rows
from lightning_zeropp.plan.simulate import StageCost

__all__ = ["stage_costs", "stage_flops"]


def stage_flops(model: nn.Module, cfg: ZeroPPLayout, rows: int, seq: int) -> list[list[float]]:
    """Forward FLOPs of one micro-batch per stage and unit: [the stage's own (non-block) part,
    then each block] (`plan.profile`, on the meta device)."""
    profile = rank_profile(model, rows, seq, cfg.param_dtype, cfg.cp_size)
    n = cfg.num_stages
    out = []
    for s, blocks in enumerate(stage_ranges(model, cfg)):
        own = (profile.before.flops if s == 0 else 0.0) + (
            profile.after.flops if s == n - 1 else 0.0
        )
        out.append([own, *(profile.blocks[i].flops for i in blocks)])
    return out


def stage_costs(
    model: nn.Module,
    cfg: ZeroPPLayout,
    global_batch: int,
    seq_len: int,
    hardware: Hardware,
    stage_seconds: Sequence[tuple[float, float]] | None = None,
    unit_seconds: Sequence[Sequence[tuple[float, float]]] | None = None,
) -> tuple[list[StageCost], dict[int, int], list[list[float]]]:
    """What one micro-batch costs each stage of a resolved config (`StageCost`), each stage's
    pipeline rank, and each stage's forward FLOPs per unit."""
    computes = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(cfg.param_dtype)
    measured = stage_seconds is not None or unit_seconds is not None
    if hardware.dtype is not None and not measured and hardware.dtype != computes:
        raise ValueError(
            f"the hardware's rate is for {hardware.dtype} but the layout computes in {computes} "
            f"(param_dtype={cfg.param_dtype}); use Hardware.from_cluster(cluster, {computes!r}) "
            f"or set param_dtype."
        )
    stages = stage_units(model, cfg)
    rows = micro_batch_rows(global_batch, cfg.dp_size, cfg.num_microbatches)
    flops = stage_flops(model, cfg, rows, seq_len)
    style = schedule_style(cfg.schedule)
    where = {s: rank_of_stage(style, s, cfg.pp_size) for s in range(cfg.num_stages)}
    parts = stage_parts(model, cfg, rows, seq_len)
    chunked = priced_chunk(model, cfg, rows, seq_len) > 0
    recompute_head = head_recompute_flops(model, rows, seq_len) if chunked else 0.0
    boundary = [part.output for part in parts]
    group = cfg.dp_size * cfg.cp_size  # ranks of one pipeline rank
    attend = _context_seconds(model, cfg, rows, seq_len, hardware)
    costs = []
    for s, stage in enumerate(stages):
        if unit_seconds is not None:
            seconds = list(unit_seconds[s])
        else:
            seconds = _unit_seconds(flops[s], hardware, stage_seconds[s] if stage_seconds else None)
            if s == cfg.num_stages - 1 and not measured and recompute_head:
                # the chunked loss's backward computes each chunk's logits again
                f, b = seconds[0]
                seconds[0] = (f, b + recompute_head / hardware.flops_per_s)
        if cfg.offloads(s):
            seconds = _offloaded(seconds, parts[s].saved, cfg, hardware)
        gather, gather_node, reduce = _collective_seconds(stage, fsdp_view(cfg), hardware, where[s])
        nxt = where.get(s + 1, where[s])
        lat, link = hardware.hop("p2p", *sorted((where[s] * group, nxt * group)))
        # CP attention's gathers (forward) and reduce-scatters (backward) in each block
        extra = [(0.0, 0.0), *[attend] * (len(seconds) - 1)]
        # the chunked loss's input pass computes the head's weight gradient too (its weight
        # pass only hands it on): the last stage's head unit has no W share
        head_in_input = chunked and s == cfg.num_stages - 1
        costs.append(
            StageCost(
                weight_share=(0.0, *[0.5] * (len(seconds) - 1)) if head_in_input else 0.5,
                forward=tuple(f + a for (f, _), (a, _) in zip(seconds, extra, strict=True)),
                backward=tuple(b + a for (_, b), (_, a) in zip(seconds, extra, strict=True)),
                gather=gather,
                gather_node=gather_node,
                reduce=reduce,
                send=lat + boundary[s] / link,
                recompute=cfg.recomputes(s),
                overhead=hardware.unit_overhead_s * len(seconds),
                # torch's stage 0 has no input gradient to compute: its split backward does
                # nothing in I and the whole backward in W (PipelineStage.backward_one_chunk)
                input_grad_in_weight=s == 0,
            )
        )
    return costs, where, flops


def _offloaded(
    seconds: list[tuple[float, float]], saved: int, cfg: ZeroPPLayout, hardware: Hardware
) -> list[tuple[float, float]]:
    """A stage's unit seconds with its activations offloaded (`core.shard.offload`): the copy to
    host runs on its own stream, exposed only where it outlasts the forward. The copy back:
    where the backward is one task it starts with it, the last unit's share first
    (`_prefetch_wait`), so only what the backward's compute cannot hide is added; a split
    backward copies back on the compute stream in each task that reads (I and W), in full."""
    if hardware.host_Bps is None:
        raise ValueError(
            f"offload_activations={cfg.offload_activations!r} is priced over the host link, but "
            "the hardware gives none: add bandwidth_GBps.host (GB/s per GPU each direction, "
            "e.g. 50 for PCIe Gen5 x16) to the cluster file, or Hardware(host_Bps=...)."
        )
    move = saved / hardware.host_Bps
    split = cfg.split_backward or cfg.schedule in SPLIT_BACKWARD
    exposed = max(0.0, move - sum(f for f, _ in seconds))
    back = 2 * move if split else _prefetch_wait(move, [b for _, b in seconds])
    out = list(seconds)
    out[-1] = (out[-1][0] + exposed, out[-1][1])
    out[0] = (out[0][0], out[0][1] + back)
    return out


def _prefetch_wait(move: float, backward: list[float]) -> float:
    """Seconds a backward of units `backward` (forward order) waits for a prefetch of `move`
    seconds that starts with it, each unit's share (equal shares) copied in the order the
    backward reads them, the last unit first: the backward's end minus its compute."""
    share = move / len(backward)
    copied = clock = 0.0
    for seconds in reversed(backward):
        copied += share
        clock = max(clock, copied) + seconds
    return clock - sum(backward)


def _unit_seconds(
    flops: list[float], hardware: Hardware, measured: tuple[float, float] | None
) -> list[tuple[float, float]]:
    if measured is None:
        return [(f / hardware.flops_per_s, 2.0 * f / hardware.flops_per_s) for f in flops]
    total = sum(flops) or 1.0
    return [(measured[0] * f / total, measured[1] * f / total) for f in flops]


def _context_seconds(
    model: nn.Module, cfg: ZeroPPLayout, rows: int, seq_len: int, hardware: Hardware
) -> tuple[float, float]:
    """Seconds of one block's CP attention traffic per micro-batch (`plan.context`): the ring
    all-gathers of K and V in the forward, the reduce-scatters of their gradients (and, by
    blocks on the CPU, the K/V gathered again) in the backward; each waited for before the
    attention runs (not overlapped). (0, 0) without CP. A device without overlap (gloo on the
    CPU) runs the attention by blocks where it applies (`plan.context.kv_traffic`)."""
    cp = cfg.cp_size
    if cp == 1:
        return 0.0, 0.0
    device = "cuda" if hardware.overlap else "cpu"  # as `plan.search` picks the device
    kv = kv_traffic(model, seq_len, cfg.param_dtype, cp, device)
    share, reduced = kv.share * rows, kv.reduce_share * rows  # this rank's bytes
    first = 0  # a CP group is cp consecutive ranks (the mesh's fastest axis)
    ag_lat, ag_bw = hardware.hop("all_gather", first, first + cp - 1, cp)
    rs_lat, rs_bw = hardware.hop("reduce_scatter", first, first + cp - 1, cp)
    # each call: (cp - 1) ring hops, of this rank's share over the calls together
    gather_again = kv.backward_calls * ag_lat + (share / ag_bw if kv.backward_calls else 0.0)
    return (
        (cp - 1) * (kv.forward_calls * ag_lat + share / ag_bw),
        (cp - 1) * (gather_again + kv.reduce_calls * rs_lat + reduced / rs_bw),
    )


_COLLECTIVES: dict[tuple, tuple[Hardware, StageUnits, tuple]] = {}  # asked for many times


def _collective_seconds(
    stage: StageUnits,
    cfg: ZeroPPLayout,
    hardware: Hardware,
    pp_rank: int,
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """All-gather, in-node-copy gather (hpZ) and reduce seconds of each unit, in the order
    `stage_flops` lists them (the stage's own part first); empty when nothing is sharded.
    ZeRO++'s collectives move what `plan.plus` counts."""
    key = (
        id(stage), id(hardware), pp_rank, cfg.dp_shard_size, cfg.dp_replicate_size,
        cfg.param_dtype, cfg.reduce_dtype, cfg.quantized_weights, cfg.quantized_gradients,
        cfg.quant_block_size, cfg.node_size, hpz_size(cfg),
    )  # fmt: skip
    hit = _COLLECTIVES.get(key)
    if hit is not None and hit[0] is hardware and hit[1] is stage:  # (ids of freed objects recur)
        return hit[2]
    out = _collectives(stage, cfg, hardware, pp_rank)
    if len(_COLLECTIVES) > 100_000:
        _COLLECTIVES.clear()
    _COLLECTIVES[key] = (hardware, stage, out)
    return out


def _collectives(
    stage: StageUnits,
    cfg: ZeroPPLayout,
    hardware: Hardware,
    pp_rank: int,
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    k, r = cfg.dp_shard_size, cfg.dp_replicate_size
    block_shapes, rest = stage.blocks, stage.rest
    if k == 1 and r == 1:
        return (), (), ()
    reduce_dtype = cfg.reduce_dtype or (torch.float32 if cfg.param_dtype else None)
    compute = cfg.param_dtype.itemsize if cfg.param_dtype else 4
    red = reduce_dtype.itemsize if reduce_dtype else compute
    first = pp_rank * cfg.dp_size
    # a shard group of consecutive ranks: min(k, node) of them in each node it spans
    per_node = min(k, hardware.node_size)
    ag_lat, ag_bw = hardware.hop("all_gather", first, first + k - 1, per_node)
    rs_lat, rs_bw = hardware.hop("reduce_scatter", first, first + k - 1, per_node)
    ar_lat, ar_bw = hardware.hop("all_reduce", first, first + cfg.dp_size - 1)
    copy = hpz_size(cfg) or 1
    cp_lat, cp_bw = hardware.hop("all_gather", first, first + copy - 1, copy)
    local = min(k, cfg.node_size or k)
    in_lat, in_bw = hardware.hop("all_to_all", first, first + local - 1, local)
    x_lat, x_bw = hardware.hop("all_to_all", first, first + k - 1, 1)
    gathers, node_gathers, reduces = [], [], []
    for shapes in [rest, *block_shapes]:
        t = unit_traffic(cfg, shapes)
        ring = k - 1 if shapes else 0  # ring hops; a unit without parameters moves nothing
        gathers.append(ring * (ag_lat + t.gather / ag_bw))
        node_gathers.append((copy - 1) * (cp_lat + t.node_gather / copy / cp_bw))
        rs = ring * (rs_lat + t.reduce // k / rs_bw) if t.reduce else 0.0
        if t.intra:  # qgZ: all-to-alls, each rank's rows to its peers (not its own row)
            rs += (local - 1) * in_lat + t.intra * (local - 1) / local / in_bw
        if t.cross:
            nodes = k // local
            rs += (nodes - 1) * x_lat + t.cross * (nodes - 1) / nodes / x_bw
        if r > 1 and shapes:  # HSDP: a ring all-reduce of the reduced shard over the replicas
            numel = padded_shard(shapes, k)
            rs += 2 * (r - 1) * (ar_lat + math.ceil(numel / r) * red / ar_bw)
        reduces.append(rs)
    return tuple(gathers), tuple(node_gathers), tuple(reduces)
