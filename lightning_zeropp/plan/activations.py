"""Activation memory per rank, predicted: bytes saved for backward at the busiest moment.

Per stage, the bytes one micro-batch's forward saves for backward (weights excluded, each storage
once) are counted by running that stage on the meta device: shapes only, no compute, so a 70B
model costs nothing to measure. The last stage's count includes the loss (token cross-entropy).

Then each pipeline rank's task order (torch's schedules' own `pipeline_order`, or ZeroPP's unit
order) is replayed: a forward adds its stage's bytes, a full backward (B) or a weight-gradient
task (W) frees them (an input-gradient task I keeps the graph for its W), and the peak is the most
held at once. This is what `core.memory.SavedActivations` measures in a run's steady state.
Attention is counted as fused kernels save it (inputs, output, a log-sum-exp row), not as the
math path the meta device would take (the whole attention matrix).

Split backward (ZeroPP's default, torch's zero-bubble schedules) holds a micro-batch's saved
bytes from its F to its W: the I runs with `retain_graph`, and the W frees the graph. (The
intermediate gradients the I keeps for its W are not saved tensors and are not counted here.)

Not modelled yet (it raises): activation recomputation.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zeropp.core._torch_private import fused_attention, storage_identity
from lightning_zeropp.core.config import ZeroPPConfig
from lightning_zeropp.core.placement import stage_ids_for_rank
from lightning_zeropp.plan.memory import split_stages

__all__ = ["stage_activation_bytes", "task_orders", "activation_peaks", "meta_stages"]

Order = list[tuple[str, int, int]]  # (kind F/B/I/W, stage, micro-batch)


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def stage_activation_bytes(
    model: nn.Module,
    config: ZeroPPConfig,
    rows: int,
    seq_len: int,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = _lm_loss,
) -> list[int]:
    """Bytes one micro-batch of `rows` x `seq_len` tokens saves in each stage (a resolved config;
    `model` on the meta device)."""
    if config.activation_checkpointing != "none":
        raise NotImplementedError("activation recomputation is not modelled yet")
    num_stages = config.num_stages
    stages = meta_stages(model, config)
    tokens = torch.zeros(rows, seq_len, dtype=torch.long, device="meta")
    x: Any = tokens
    out = []
    for index, stage in enumerate(stages):
        saved: dict[int, int] = {}
        params = {storage_identity(p) for p in stage.parameters()}

        def pack(t: torch.Tensor, saved: dict[int, int] = saved, params: set = params) -> Any:
            key = storage_identity(t)
            if key not in params:
                saved.setdefault(key, t.untyped_storage().nbytes())
            return t

        with _fused_attention(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = stage(x)
            if index == num_stages - 1:
                loss_fn(y, tokens)
        out.append(sum(saved.values()))
        x = y.detach().requires_grad_()
    return out


@contextlib.contextmanager
def _fused_attention() -> Iterator[None]:
    """Count attention as the fused kernels of real runs save it (`_torch_private.fused_attention`)."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = fused_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def meta_stages(model: nn.Module, config: ZeroPPConfig) -> list[nn.Module]:
    """The stage modules the engine would build (a resolved config), in the compute dtype."""
    stages = split_stages(model, config)
    if config.num_stages == 1:
        stages = [copy.deepcopy(model)]  # cast below: leave the caller's model as it is
    if config.param_dtype is not None:  # computed in the mixed-precision dtype, as FSDP2 runs it
        stages = [stage.to(config.param_dtype) for stage in stages]
    return stages


def task_orders(config: ZeroPPConfig) -> dict[int, Order]:
    """Every pipeline rank's compute tasks in order, as its schedule runs them."""
    if config.schedule == "zeropp":
        from lightning_zeropp.core.schedule import zeropp_orders

        return {
            r: [(t.kind, t.stage, t.microbatch) for t in order]
            for r, order in zeropp_orders(config).items()
        }
    from lightning_zeropp.core.schedule import SCHEDULES

    cls, style = SCHEDULES[config.schedule]
    assert cls is not None
    if style == "single":
        return {r: _single_stage_order(config, r) for r in range(config.pp_size)}
    orders = {}
    for rank in range(config.pp_size):
        ids = stage_ids_for_rank(style, rank, config.pp_size, config.num_chunks)
        stages = [_stand_in(s, rank, config) for s in ids]
        schedule = cls(stages[0] if style == "single" else stages, config.num_microbatches)
        orders[rank] = [
            (a.computation_type.value, a.stage_index, a.microbatch_index)
            for a in schedule.pipeline_order[rank]
            if a is not None and a.computation_type.value in ("F", "B", "I", "W")
        ]
    return orders


def _single_stage_order(config: ZeroPPConfig, rank: int) -> Order:
    """GPipe's and 1F1B's order as their `_step_microbatches` runs it (their `pipeline_order` is
    only a drawing, and 1F1B's numbers the last rank's micro-batches from 1)."""
    m = config.num_microbatches
    if config.schedule == "gpipe":
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    warmup = min(m, config.pp_size - rank)  # torch's 1F1B: one more than the textbook's
    order: Order = [("F", rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("B", rank, i), ("F", rank, warmup + i)]
    return order + [("B", rank, i) for i in range(m - warmup, m)]


def _stand_in(stage: int, rank: int, config: ZeroPPConfig) -> SimpleNamespace:
    """What a torch schedule's constructor reads of a stage to plan its order."""
    n = config.num_stages
    return SimpleNamespace(
        stage_index=stage, num_stages=n, group_rank=rank, group_size=config.pp_size,
        stage_index_to_group_rank={}, has_backward=True, is_first=stage == 0,
        is_last=stage == n - 1, submod=None,
    )  # fmt: skip


def activation_peaks(
    model: nn.Module, config: ZeroPPConfig, world_size: int, global_batch: int, seq_len: int
) -> dict[int, int]:
    """Each pipeline rank's peak saved-activation bytes in a step of `global_batch` rows."""
    cfg = config.resolve(world_size)
    rows = global_batch // cfg.dp_size // cfg.num_microbatches
    per_stage = stage_activation_bytes(model, cfg, rows, seq_len)
    if cfg.pp_size == 1 and cfg.num_stages == 1:
        return {0: per_stage[0]}  # micro-batches run one after another
    peaks = {}
    for rank, order in task_orders(cfg).items():
        live = peak = 0
        for kind, stage, _ in order:
            if kind == "F":
                live += per_stage[stage]
            elif kind in "BW":  # I keeps the graph for its W
                live -= per_stage[stage]
            peak = max(peak, live)
        peaks[rank] = peak
    return peaks
