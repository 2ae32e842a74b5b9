"""`ZeroPPConfig`: what a user asks of a ZeroPP run, the one vocabulary every front speaks.

A config may leave sizes and policies unset (None); `resolve(world_size, node_size)` fills them in
and checks everything a user can get wrong (`core.settings.resolve`), returning a frozen, fully
typed `ZeroPPLayout` that the engine, the planner and the fronts read. Every rank resolves the same
config before the first collective, so a bad setting fails everywhere at once instead of leaving
some ranks waiting in a collective. Nothing here reads the environment: the fronts merge code
arguments over `ZEROPP_*` variables first (`fronts.settings`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.settings.resolve import resolve_config
from lightning_zeropp.core.settings.values import (
    GRAD_REDUCE,
    NONFINITE,
    RECOMPUTE,
    parse_dtype,
    schedule_name,
)

__all__ = [
    "GRAD_REDUCE",
    "NONFINITE",
    "RECOMPUTE",
    "ZeroPPConfig",
    "ZeroPPLayout",
    "parse_dtype",
    "schedule_name",
]


@dataclass(kw_only=True)
class ZeroPPConfig:
    """Layout and schedule of a ZeroPP run.

    World = pp_size x dp_replicate_size x dp_shard_size x cp_size. Weights, gradients and optimizer
    state are sharded (ZeRO-3, FSDP2) over `dp_shard` (consecutive ranks, i.e. inside a node) and
    replicated over `dp_replicate` (HSDP when > 1). Each pipeline rank holds `num_chunks` model chunks.

    `cp_size` (context parallelism): each sequence is split over `cp_size` consecutive ranks, which
    read the same batch; each stage's weights are sharded over dp_shard x cp (`core.step.context`).

    Defaults: `pp_size` from the other sizes when they are given, else 2 when the world splits
    into two pipeline stages (an even number of data-parallel groups) and 1 otherwise (a planner
    will choose later); `dp_shard_size` fills the rest of the world; `num_chunks` 1 for
    single-stage schedules and 2 for interleaved / V schedules; `num_microbatches` equals the number
    of pipeline ranks (the least 1F1B accepts); no resharding after forward when `pp_size > 1`
    (torchtitan's default: one gather per stage and step instead of one per micro-batch).

    `schedule="zeropp"` runs micro-batches in units of `unit_size` (U, default `pp_size`, at least
    `pp_size`); each chunk's weights are gathered once per block of a unit and released after it.
    Its backward is split into input- and weight-gradient tasks (`split_backward`, default on), and
    `grad_reduce` says when gradients are reduce-scattered: once per "step" (default), per "unit",
    or per "microbatch" (the latter two free unsharded gradients sooner, at more communication).

    `activation_checkpointing` (recomputation): False / "none", True / "all" (every block), or
    "except_last" (every block except those of the last stage, whose activations are consumed
    right after they are made: ZeroPP's policy). Recomputed stages run a full backward.

    `offload_activations`: the stages' saved activations copied to host memory in forward and
    back in backward (False / "off", True / "on": every pipeline rank, "auto": the ranks holding
    more micro-batches in flight than the mean under the schedule, the first half under 1F1B; or
    a list of pipeline ranks, as the planner chooses them);
    `recompute_ranks`: the pipeline ranks whose stages recompute as `activation_checkpointing`
    says (None: every rank) (`core.settings.ranks`, `core.shard.offload`).

    `nonfinite`: a NaN or inf training loss raises on every rank naming the step and the stage
    ("raise", default) or drops that step's gradients on every rank ("skip"); `core.step.nonfinite`.

    ZeRO++ and offload (`core.settings.plus` describes each): `quantized_weights` (qwZ),
    `hpz_partition_size` (hpZ), `quantized_gradients` (qgZ), `gradient_error_feedback`,
    `quant_block_size`, `cpu_offload`, and `node_size` (ranks per node).

    `save_on_sigterm`: on SIGTERM (a scheduler preempting the job) every rank stops at the next
    step boundary and exits with 143 naming SIGTERM; with this on, the front first saves a
    checkpoint where a restart resumes from (`core.step.preempt`).

    `loss_chunk`: tokens per chunk of the head and the cross-entropy on the last stage, where
    the library computes that loss (the bundled GPT, HF causal LMs' own loss): the logits of a
    micro-batch never exist whole, forward or backward; 0 computes whole logits; None (default)
    1024 tokens where the run can chunk and whole logits where it cannot (`split` other than
    the call split, context parallelism). A number > 0 where the run cannot chunk is refused
    at setup (`core.step.chunked_loss`).

    `compile`: `torch.compile` each block after the model is cut into stages; under schedules
    that split backward into input- and weight-gradient tasks, the regions between the blocks'
    weights (`core.shard.compile`).
    """

    pp_size: int | None = None
    dp_shard_size: int | None = None
    dp_replicate_size: int = 1
    cp_size: int = 1
    num_microbatches: int | None = None
    schedule: str = "1f1b"
    num_chunks: int | None = None
    param_dtype: torch.dtype | str | None = None
    reduce_dtype: torch.dtype | str | None = None
    activation_checkpointing: bool | str = False
    recompute_ranks: list[int] | None = None
    offload_activations: bool | str | list[int] = False
    reshard_after_forward: bool | None = None
    split_points: list[int] | None = field(default=None)
    unit_size: int | None = None
    split_backward: bool | None = None
    grad_reduce: str = "step"
    nonfinite: str = "raise"
    quantized_weights: str | None = None
    hpz_partition_size: int | None = None
    quantized_gradients: str | None = None
    gradient_error_feedback: bool | None = None
    quant_block_size: int = 256
    cpu_offload: bool = False
    node_size: int | None = None
    compile: bool = False
    save_on_sigterm: bool = False
    loss_chunk: int | None = None

    def resolve(self, world_size: int, node_size: int | None = None) -> ZeroPPLayout:
        """Every default filled in and every setting checked, for `world_size` processes of which
        `node_size` consecutive ones share a node (the launcher's; default: `self.node_size`,
        else the whole world). Pure: reads no environment variable."""
        return resolve_config(self, world_size, node_size)
