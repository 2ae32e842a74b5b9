"""Communication per rank and step, predicted: the calls and bytes `core.measure.comm.CommCounter` counts.

- all-gather (dp_shard): one call per FSDP unit (each block of a stage, then the stage's other
  parameters) each time its stage is gathered, of this rank's padded shard in the compute dtype.
  How often: torch's pipeline schedules (no resharding after forward, their default) once per
  step per stage; ZeroPP once per gather of its plan (`core.schedule.build.zeropp_plans`); FSDP alone
  (pp 1, resharding after forward) M + 1 times for M micro-batches: the first forward, then every
  backward (gradient accumulation keeps a backward's weights gathered, so the next micro-batch's
  forward finds them, and resharding after that forward makes its backward gather again);
- reduce-scatter (dp_shard): one call per unit per reduction (once per step, or at ZeroPP's
  early reductions too), of the whole padded gradient in the reduce dtype (fp32 under bf16
  compute unless set);
- send / recv (pp): per micro-batch, a stage's output to the next stage and the gradient of its
  input back, where the two stages sit on different ranks; sizes from running the stages on the
  meta device.

Not modelled (they raise): resharding after forward under a pipeline, ZeRO++'s collectives, and
the engine's few scalar collectives (the loss, two agreement flags), which are left out.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.settings.placement import (
    rank_of_stage,
    schedule_style,
    stage_ids_for_rank,
)
from lightning_zeropp.plan.activations import stage_parts, zeropp_plans
from lightning_zeropp.plan.memory import stage_units
from lightning_zeropp.plan.profile import micro_batch_rows

__all__ = ["predict_comm"]

Summary = dict[str, dict[str, dict[str, int]]]


def _padded_shard(shapes: list[tuple[int, ...]], shards: int) -> int:
    return sum(math.ceil(s[0] / shards) * math.prod(s[1:]) if s else 1 for s in shapes)


def predict_comm(
    model: nn.Module, config: ZeroPPConfig, world_size: int, global_batch: int, seq_len: int
) -> dict[int, Summary]:
    """Each global rank's predicted `CommCounter` summary of one training step (all-gather,
    reduce-scatter, send and recv only)."""
    cfg = config.resolve(world_size)
    if cfg.pp_size > 1 and cfg.reshard_after_forward:
        raise NotImplementedError("resharding after forward under a pipeline is not modelled")
    if cfg.quantized_weights or cfg.quantized_gradients or cfg.hpz_partition_size:
        raise NotImplementedError("ZeRO++'s collectives are not modelled here yet")
    stages = stage_units(model, cfg)
    compute = torch.empty((), dtype=cfg.param_dtype).element_size() if cfg.param_dtype else 4
    reduce_dtype = cfg.reduce_dtype or (torch.float32 if cfg.param_dtype else None)
    reduce = torch.empty((), dtype=reduce_dtype).element_size() if reduce_dtype else compute
    rows = micro_batch_rows(global_batch, cfg.dp_size, cfg.num_microbatches)
    boundary = [part.output for part in stage_parts(model, cfg, rows, seq_len)]
    gathers, reductions = _gathers_and_reductions(cfg)
    style = schedule_style(cfg.schedule)
    out = {}
    for rank in range(world_size):
        pp_rank = rank // cfg.dp_size
        summary: Summary = {}
        for stage in stage_ids_for_rank(style, pp_rank, cfg.pp_size, cfg.num_chunks):
            block_shapes, rest = stages[stage].blocks, stages[stage].rest
            shapes = [
                *block_shapes,
                *([rest] if rest else []),
            ]  # a unit without parameters: no gather
            units = [_padded_shard(u, cfg.dp_shard_size) for u in shapes]
            if cfg.dp_shard_size > 1:
                _add(summary, "all_gather", "dp_shard", gathers[stage] * len(units),
                     gathers[stage] * sum(units) * compute)  # fmt: skip
                _add(summary, "reduce_scatter", "dp_shard", reductions[stage] * len(units),
                     reductions[stage] * cfg.dp_shard_size * sum(units) * reduce)  # fmt: skip
            m = cfg.num_microbatches
            if (
                stage + 1 < cfg.num_stages
                and rank_of_stage(style, stage + 1, cfg.pp_size) != pp_rank
            ):
                _add(summary, "send", "pp", m, m * boundary[stage])  # activations forward
                _add(summary, "recv", "pp", m, m * boundary[stage])  # their gradients back
            if stage > 0 and rank_of_stage(style, stage - 1, cfg.pp_size) != pp_rank:
                _add(summary, "recv", "pp", m, m * boundary[stage - 1])
                _add(summary, "send", "pp", m, m * boundary[stage - 1])
        out[rank] = summary
    return out


def _add(summary: Summary, kind: str, axis: str, count: int, nbytes: int) -> None:
    entry = summary.setdefault(kind, {}).setdefault(axis, {"count": 0, "bytes": 0})
    entry["count"] += count
    entry["bytes"] += nbytes


def _gathers_and_reductions(cfg: ZeroPPConfig) -> tuple[dict[int, int], dict[int, int]]:
    """How many times per step each stage is gathered and its gradients reduced."""
    stages = range(cfg.num_stages)
    if cfg.schedule == "zeropp":
        gathers, early = dict.fromkeys(stages, 0), dict.fromkeys(stages, 0)
        for plan in zeropp_plans(cfg).values():
            for step in plan:
                if step.kind == "gather":
                    gathers[step.stage] += 1
                elif step.kind == "reduce":
                    early[step.stage] += 1
        return gathers, {s: 1 + early[s] for s in stages}
    per_step = cfg.num_microbatches + 1 if cfg.num_stages == 1 else 1
    return dict.fromkeys(stages, per_step), dict.fromkeys(stages, 1)
