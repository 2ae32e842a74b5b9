"""Activation memory per rank, predicted: bytes saved for backward at the busiest moment.

Per stage, the bytes one micro-batch's forward saves for backward (weights excluded, each storage
once) come from `plan.profile` (the model run once on the meta device, block by block: shapes
only, so a 70B model costs nothing to measure); the last stage's include the loss, computed as
the run computes it: in chunks of `loss_chunk` tokens where the runtime chunks (`plan.loss_chunk`:
the hidden states kept, not a micro-batch's fp32 logits), else from whole logits.

Then each pipeline rank's task order (`plan.orders`: torch's schedules' own `pipeline_order`, or
ZeroPP's unit order) is replayed: a forward adds its stage's bytes, a full backward (B) or a weight-gradient
task (W) frees them (an input-gradient task I keeps the graph for its W), and the peak is the most
held at once. This is what `core.measure.memory.SavedActivations` measures in a run's steady state.
Attention is counted as fused kernels save it (inputs, output, a log-sum-exp row), not as the
math path the meta device would take (the whole attention matrix).

Split backward (ZeroPP's default, torch's zero-bubble schedules) holds a micro-batch's saved
bytes from its F to its W: the I runs with `retain_graph`, and the W frees the graph. (The
intermediate gradients the I keeps for its W are not saved tensors and are not counted here.)

Context parallelism (`cp_size`): every figure is one CP rank's (`plan.context.rank_profile`: its
part of each sequence, plus the gathered keys and values and the mask its attention keeps).

Recomputation: a recomputing stage's blocks save their inputs only (counted with the engine's
own checkpoint wrapping); while one block runs backward it holds its activations again
(`recompute_transients`), which saved-tensor tracking does not see and the peak adds.
Recomputation and offload are chosen per pipeline rank (`recompute_ranks`,
`offload_activations`): `recomputes(stage)` and `offloads(stage)` say which.

Offload (`core.shard.offload`): an offloading stage's saved bytes live in host memory from its F
to its B or W; on the device it holds one micro-batch's bytes while a backward task of it runs
(copied back, as the memory report does not see), which the peak adds.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.plan.context import rank_profile
from lightning_zeropp.plan.cut import settle
from lightning_zeropp.plan.loss_chunk import chunked_profile, priced_chunk
from lightning_zeropp.plan.loss_memory import held_weight_gradient, last_stage_transients
from lightning_zeropp.plan.memory import _stage_ranges, stage_ranges
from lightning_zeropp.plan.orders import task_orders
from lightning_zeropp.plan.profile import Part, micro_batch_rows

__all__ = [
    "activation_peaks",
    "host_activation_peaks",
    "recompute_transients",
    "stage_activation_bytes",
    "stage_parts",
    "task_orders",
]


def stage_parts(
    model: nn.Module, config: ZeroPPLayout, rows: int, seq_len: int, device_type: str = "cuda"
) -> list[Part]:
    """One micro-batch of `rows` x `seq_len` tokens on each stage (a resolved config; `model` on
    the meta device): saved bytes (recomputing stages: their blocks' inputs), FLOPs, output.
    `device_type` decides what CP attention keeps (`plan.context.rank_profile`)."""
    points = tuple(config.split_points) if config.split_points else None
    recompute = tuple(config.recomputes(s) for s in range(config.num_stages))
    chunked = priced_chunk(model, config, rows, seq_len) > 0
    return list(
        _stage_parts(
            model, config.num_stages, points, rows, seq_len, config.param_dtype, recompute,
            config.cp_size, chunked, device_type,
        )
    )  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _stage_parts(
    model: nn.Module,
    num_stages: int,
    points: tuple[int, ...] | None,
    rows: int,
    seq_len: int,
    dtype: Any,
    recompute: tuple[bool, ...],
    cp: int = 1,
    chunked: bool = False,
    device_type: str = "cuda",
) -> tuple[Part, ...]:
    profile = rank_profile(model, rows, seq_len, dtype, cp, device_type)
    if chunked:  # the last stage keeps the hidden states, not the logits (`plan.loss_chunk`)
        profile = chunked_profile(model, profile, rows, seq_len, dtype)
    cut = _stage_ranges(model, num_stages, points)
    return tuple(
        profile.stage(r, s == 0, s == num_stages - 1, recompute[s]) for s, r in enumerate(cut)
    )


def stage_activation_bytes(
    model: nn.Module, config: ZeroPPLayout, rows: int, seq_len: int, device_type: str = "cuda"
) -> list[int]:
    """Bytes one micro-batch saves in each stage (see `stage_parts`)."""
    return [part.saved for part in stage_parts(model, config, rows, seq_len, device_type)]


def recompute_transients(
    model: nn.Module, config: ZeroPPLayout, rows: int, seq_len: int, device_type: str = "cuda"
) -> list[int]:
    """Per stage, what recomputing holds on top of the saved bytes while a block runs backward:
    the largest block's own saved bytes (0 for a stage that does not recompute)."""
    profile = rank_profile(model, rows, seq_len, config.param_dtype, config.cp_size, device_type)
    return [
        max((profile.blocks[i].saved for i in r), default=0) if config.recomputes(s) else 0
        for s, r in enumerate(stage_ranges(model, config))
    ]


def activation_peaks(
    model: nn.Module,
    config: ZeroPPConfig | ZeroPPLayout,
    world_size: int,
    global_batch: int,
    seq_len: int,
    *,
    transients: bool = True,
    device_type: str = "cuda",
    recompute_transient: bool | None = None,
) -> dict[int, int]:
    """Each pipeline rank's peak activation bytes in a step of `global_batch` rows: the saved
    bytes, plus (`transients`) what a recomputing block holds during its backward and what the
    head and the loss hold while they run (`plan.loss_memory`), on a `device_type` device
    ("cuda", or "cpu" for gloo ranks: CP attention differs). `recompute_transient`: the
    earlier name of `transients`.

    Under a split backward, the last stage also holds from each micro-batch's I to its W what the
    chunked loss keeps for the weight pass (`plan.loss_memory.held_weight_gradient`)."""
    if recompute_transient is not None:
        transients = recompute_transient
    config = settle(model, config, seq_len, world_size)  # no split points: the engine's cut
    cfg = config.resolve(world_size)
    rows = micro_batch_rows(global_batch, cfg.dp_size, cfg.num_microbatches)
    per_stage = stage_activation_bytes(model, cfg, rows, seq_len, device_type)
    extra = recompute_transients(model, cfg, rows, seq_len, device_type)
    last = cfg.num_stages - 1
    loss_f, loss_b = last_stage_transients(model, cfg, rows, seq_len) if transients else (0, 0)
    extra = [0] * len(extra) if not transients else extra
    extra[last] = max(extra[last], loss_b)  # not at once: the loss's backward precedes the blocks'
    # not a saved tensor either: left out with the transients, as the memory report leaves it
    held = held_weight_gradient(model, cfg, rows, seq_len) if transients else 0
    if cfg.pp_size == 1 and cfg.num_stages == 1:
        return {0: per_stage[0] + max(extra[0], loss_f)}  # micro-batches run one after another
    peaks = {}
    host = [cfg.offloads(s) for s in range(cfg.num_stages)]
    for rank, order in task_orders(cfg).items():
        live = peak = 0
        for kind, stage, _ in order:
            kept = 0 if host[stage] else per_stage[stage]  # offloaded: on the host meanwhile
            if kind == "F":
                live += kept
                # the head and the loss run at the forward's end: all it saved is held then
                peak = max(peak, live + (loss_f if stage == last else 0))
            elif kind in "BI":  # a recomputing block's activations exist again for a moment
                peak = max(peak, live + extra[stage])
            if kind in "BIW" and host[stage]:  # copied back for the task, freed after it
                peak = max(peak, live + per_stage[stage] + extra[stage])
            if kind in "BW":  # I keeps the graph for its W
                live -= kept
            if stage == last and kind in "IW":  # the head's weight gradient, from I to W
                live += held if kind == "I" else -held
            peak = max(peak, live)
        peaks[rank] = peak
    return peaks


def host_activation_peaks(
    model: nn.Module,
    config: ZeroPPConfig | ZeroPPLayout,
    world_size: int,
    global_batch: int,
    seq_len: int,
) -> dict[int, int]:
    """Each pipeline rank's most saved-activation bytes held in host memory at once (0 where it
    does not offload): what `activation_peaks` moved off the device."""
    config = settle(model, config, seq_len, world_size)
    cfg = config.resolve(world_size)
    rows = micro_batch_rows(global_batch, cfg.dp_size, cfg.num_microbatches)
    per_stage = stage_activation_bytes(model, cfg, rows, seq_len)
    out = {}
    for rank, order in task_orders(cfg).items():
        live = peak = 0
        for kind, stage, _ in order:
            moved = per_stage[stage] if cfg.offloads(stage) else 0
            live += moved if kind == "F" else -moved if kind in "BW" else 0
            peak = max(peak, live)
        out[rank] = peak
    return out
