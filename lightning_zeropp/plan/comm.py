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
  meta device;
- ZeRO++ (`plan.plus`): qwZ's gathers move the packed shard; hpZ's backward gathers (axis "hpz")
  its in-node copy, where the step's programs (`plan.programs.programs_for`) read it; qgZ
  replaces each reduce-scatter with all-to-alls inside the node ("zeropp_plus_intra") and
  across nodes ("zeropp_plus_cross"), each counted with its whole packed input.

- context parallelism (`plan.context`): FSDP's gathers and reductions over dp_shard x cp (named
  "dp_shard"); per block and micro-batch, K and V all-gathered over "cp" in each forward
  (recomputation included) and their gradients reduce-scattered in the backward, as the
  attention runs on the `device_type` device (`plan.context.kv_traffic`: masked on a GPU, two
  calls each way; by blocks on the CPU, one stacked call each way, the K/V gathered again in
  the backward, their gradients reduced in fp32 for a 2-byte run).

Not modelled (it raises): resharding after forward under a pipeline; left out: the engine's few
scalar collectives (the loss, the step's four agreement flags).
"""

from __future__ import annotations

import math

from torch import nn

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.settings.placement import (
    rank_of_stage,
    schedule_style,
    stage_ids_for_rank,
)
from lightning_zeropp.plan.activations import stage_parts
from lightning_zeropp.plan.context import fsdp_view, kv_traffic
from lightning_zeropp.plan.memory import stage_units
from lightning_zeropp.plan.plus import unit_traffic
from lightning_zeropp.plan.profile import micro_batch_rows
from lightning_zeropp.plan.programs import programs_for

__all__ = ["padded_shard", "predict_comm"]

Summary = dict[str, dict[str, dict[str, int]]]


def padded_shard(shapes: list[tuple[int, ...]], shards: int) -> int:
    return sum(math.ceil(s[0] / shards) * math.prod(s[1:]) if s else 1 for s in shapes)


def predict_comm(
    model: nn.Module,
    config: ZeroPPConfig | ZeroPPLayout,
    world_size: int,
    global_batch: int,
    seq_len: int,
    device_type: str = "cuda",
) -> dict[int, Summary]:
    """Each global rank's predicted `CommCounter` summary of one training step (all-gather,
    reduce-scatter, ZeRO++'s all-to-alls, send and recv only) on `device_type` devices ("cuda",
    or "cpu" for gloo ranks: CP attention's traffic differs)."""
    cfg = config.resolve(world_size)
    fsdp = fsdp_view(cfg)  # under CP, FSDP's group is dp_shard x cp
    if cfg.pp_size > 1 and cfg.reshard_after_forward:
        raise NotImplementedError("resharding after forward under a pipeline is not modelled")
    stages = stage_units(model, cfg)
    rows = micro_batch_rows(global_batch, cfg.dp_size, cfg.num_microbatches)
    boundary = [part.output for part in stage_parts(model, cfg, rows, seq_len)]
    programs = programs_for(cfg)
    style = schedule_style(cfg.schedule)
    kv = kv_traffic(model, seq_len, cfg.param_dtype, cfg.cp_size, device_type)
    out = {}
    for rank in range(world_size):
        pp_rank = rank // fsdp.dp_size
        summary: Summary = {}
        ops = programs[pp_rank]
        for stage in stage_ids_for_rank(style, pp_rank, cfg.pp_size, cfg.num_chunks):
            block_shapes, rest = stages[stage].blocks, stages[stage].rest
            shapes = [
                *block_shapes,
                *([rest] if rest else []),
            ]  # a unit without parameters: no gather
            full = sum(1 for op in ops if op.stage == stage and op.gather and not op.from_node)
            node = sum(1 for op in ops if op.stage == stage and op.gather and op.from_node)
            reduced = sum(1 for op in ops if op.stage == stage and op.reduce)
            if fsdp.dp_shard_size > 1:
                _count_units(summary, fsdp, shapes, full, node, reduced)
            m = cfg.num_microbatches
            if kv.share:  # CP attention: K and V gathered per block and forward (by blocks,
                # again per backward), their gradients reduced per backward
                forwards = m * len(block_shapes) * (2 if cfg.recomputes(stage) else 1)
                backwards = m * len(block_shapes)
                again = backwards if kv.backward_calls else 0
                calls = forwards * kv.forward_calls + backwards * kv.backward_calls
                _add(summary, "all_gather", "cp", calls, (forwards + again) * kv.share * rows)
                # a reduce-scatter's input is the whole gathered gradient (CommCounter's count)
                moved = backwards * kv.reduce_share * rows * cfg.cp_size
                _add(summary, "reduce_scatter", "cp", backwards * kv.reduce_calls, moved)
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


def _count_units(
    summary: Summary,
    cfg: ZeroPPLayout,
    units: list[list[tuple[int, ...]]],
    full: int,
    node: int,
    reduced: int,
) -> None:
    """A stage's units gathered `full` times over the shard group, `node` times from hpZ's
    copy, and reduced `reduced` times (`plan.plus`: what each call moves)."""
    traffic = [unit_traffic(cfg, shapes) for shapes in units]
    n = len(traffic)
    _add(summary, "all_gather", "dp_shard", full * n, full * sum(t.gather for t in traffic))
    if node:
        _add(summary, "all_gather", "hpz", node * n, node * sum(t.node_gather for t in traffic))
    local = min(cfg.dp_shard_size, cfg.node_size or cfg.dp_shard_size)
    # a hop whose group is the whole shard group (one node, or one rank a node) is named by it
    intra = "dp_shard" if local == cfg.dp_shard_size else "zeropp_plus_intra"
    cross = "dp_shard" if local == 1 else "zeropp_plus_cross"
    for kind, axis, field in (
        ("reduce_scatter", "dp_shard", "reduce"),
        ("all_to_all", intra, "intra"),
        ("all_to_all", cross, "cross"),
    ):
        moved = [getattr(t, field) for t in traffic]
        if any(moved):
            _add(summary, kind, axis, reduced * n, reduced * sum(moved))


def _add(summary: Summary, kind: str, axis: str, count: int, nbytes: int) -> None:
    entry = summary.setdefault(kind, {}).setdefault(axis, {"count": 0, "bytes": 0})
    entry["count"] += count
    entry["bytes"] += nbytes
