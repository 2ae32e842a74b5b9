"""How `ZeroPPEngine` sets up this rank's part of the model: the block plan, the split method the
model can take, and its stages split, compiled, checkpointed, sharded and given their values.

The order is the engine's build order (docs/architecture.md): split (`core.split`), shard
(`core.shard`), values (`core.weights`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_zeropp.core.mesh import ParallelDims, mesh_coordinates
from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.settings.placement import (
    schedule_style,
    splits_backward,
    stage_ids_for_rank,
)
from lightning_zeropp.core.shard.compile import compile_blocks
from lightning_zeropp.core.shard.fsdp import apply_activation_checkpointing, shard_stage
from lightning_zeropp.core.shard.offload import OffloadStats, apply_activation_offload
from lightning_zeropp.core.shard.plus import Plus
from lightning_zeropp.core.split.blocks import BlockPlan, find_blocks, plan_blocks
from lightning_zeropp.core.split.call_plan import CallInputs
from lightning_zeropp.core.split.cost import cost_cut, guess_seq_len, measure_costs, rank_loads
from lightning_zeropp.core.split.methods import SplitMethod, check_no_tied_parameters, split_model
from lightning_zeropp.core.split.modules import merge_stage_modules
from lightning_zeropp.core.split.outputs import flatten_outputs
from lightning_zeropp.core.split.tied import TiedWeights, tied_groups
from lightning_zeropp.core.step.failure import describe_rank
from lightning_zeropp.core.weights.init_modules import InitFn, default_init
from lightning_zeropp.core.weights.materialize import Source, fill_values, real_to

__all__ = ["Built", "block_plan", "build_stages", "rank_describer", "settle_split"]


def block_plan(
    model: nn.Module,
    config: ZeroPPLayout,
    example_args: tuple[Any, ...] | None = None,
    example_kwargs: dict[str, Any] | None = None,
) -> BlockPlan | None:
    """The block plan; a single stage without a block container is sharded at its root only.

    Given `split_points` win; otherwise stages are cut by cost (`core.split.cost`: forward +
    backward FLOPs of every block, the embedding and the head with the loss, measured on the meta
    device at the example batch's sequence) so that the busiest pipeline rank, under the
    schedule's placement, is least busy; a model the profile cannot run is cut by parameters."""
    num_stages = config.num_stages
    if num_stages == 1:
        try:
            find_blocks(model)
        except ValueError:
            return None
    plan = plan_blocks(model, num_stages, config.split_points)
    if config.split_points is not None:
        return dataclasses.replace(plan, basis="the given split_points")
    if num_stages == 1:
        return plan
    seq_len, source = guess_seq_len(model, example_args, example_kwargs)
    recompute = config.activation_checkpointing != "none"
    costs = measure_costs(model, seq_len, recompute)
    if isinstance(costs, str):
        return dataclasses.replace(plan, basis=f"parameters (cost not measured: {costs})")
    style = schedule_style(config.schedule)
    even = [r.start for r in plan.ranges]
    starts = cost_cut(costs, num_stages, style, config.pp_size, even)
    busiest = [max(rank_loads(costs, c, style, config.pp_size)) for c in (starts, even)]
    total = sum(rank_loads(costs, even, style, config.pp_size))
    basis = (
        f"cost (forward + backward FLOPs at {seq_len} tokens, from {source}; head and loss "
        f"{costs.head_in_blocks():.1f} blocks; busiest pp rank {busiest[0] / total:.1%} of the "
        f"work, cut by parameters {busiest[1] / total:.1%})"
    )
    cut = plan_blocks(model, num_stages, starts[1:])
    return dataclasses.replace(cut, basis=basis, costs=costs)


def settle_split(
    model: nn.Module,
    asked: SplitMethod,
    resolved: SplitMethod,
    config: ZeroPPLayout,
    plan: BlockPlan | None,
    meta: bool,
) -> SplitMethod:
    """The split method the model's stages are cut with: `resolved` (from `asked`), unless the
    model prefers tracing (`asked="auto"`) and its meta build or mixed precision rules it out.
    Raises when `compile=True` finds no blocks, or an explicit `split="trace"` a meta model."""
    if config.compile and plan is None:
        raise ValueError(
            f"compile=True compiles each block of the model, but {type(model).__name__} has "
            "no blocks (a ModuleList, ModuleDict or nn.Sequential of at least 2 layers); "
            "compile the model yourself (torch.compile) and leave compile=False."
        )
    split = resolved
    if meta and split == "trace" and config.num_stages > 1:
        # Tracing records the device of every value: a meta model's graph runs on meta.
        if asked != "auto":
            raise ValueError(
                "split='trace' cannot cut a model whose parameters are on the meta device "
                "(the traced graph would keep running on it); use split='call' (the "
                "default), or build the model with its weights."
            )
        split = "call"  # the model prefers tracing; its meta build rules it out
    if split == "trace" and asked == "auto" and _recast(model, config.param_dtype):
        # A traced graph keeps the dtypes it was traced in: a cast to float32 that was a
        # no-op then (HF's norms) is recorded as a check, and fails on bf16 activations
        # (an explicit split="trace" is checked for such casts once traced).
        split = "call"  # the model prefers tracing; mixed precision rules it out
    return split


@dataclass
class Built:
    """This rank's stages, as `build_stages` leaves them."""

    modules: list[nn.Module]  # one per stage id, in `stage_ids` order
    module: nn.Module  # all of them under one root (`merge_stage_modules`)
    tied: TiedWeights
    call_inputs: CallInputs | None  # split="call" stages take the model inputs on every rank
    plus: Plus  # ZeRO++'s groups
    offload: OffloadStats | None = None  # what the activation offload moved (None: no stage does)


def build_stages(
    model: nn.Module,
    config: ZeroPPLayout,
    plan: BlockPlan | None,
    stage_ids: list[int],
    split: SplitMethod,
    dims: ParallelDims,
    device: torch.device,
    meta: bool,
    example_args: tuple[Any, ...] | None,
    example_kwargs: dict[str, Any] | None,
    init: InitFn | None,
    load_from: str | Path | None,
    recompute_under: Any = None,
) -> Built:
    """Split `model` into this rank's stages, prepare and shard each, and fill their values
    (a meta model's from `init` or `load_from`; a built one's from `load_from` if given)."""
    num_stages = config.num_stages
    # Tied weights get a copy per stage under split="call" / "stack" (see core.split.tied).
    tied = tied_groups(model) if num_stages > 1 else []
    if num_stages > 1 and split not in ("call", "stack"):
        check_no_tied_parameters(model)
    # split="call" stages take the model inputs on every rank (see core.split.call_plan).
    call_inputs = CallInputs() if split == "call" and num_stages > 1 else None
    modules = split_model(
        model,
        plan,
        stage_ids,
        split,
        example_args,
        example_kwargs,
        call_inputs=call_inputs,
        device=device,
        dtype=config.param_dtype,
    )
    if num_stages == 1:
        flatten_outputs(modules[0])  # call stages flatten their own outputs
    plus = Plus.build(dims.mesh, config)  # ZeRO++'s groups: every rank, in one order
    offload = OffloadStats() if any(config.offloads(s) for s in stage_ids) else None
    for stage_id, module in zip(stage_ids, modules, strict=True):
        blocks = plan.stage_blocks(stage_id) if plan is not None else []
        _prepare_stage(module, stage_id, blocks, config, dims, device, meta, plus, recompute_under)
        if offload is not None and config.offloads(stage_id):
            # Around the whole stage (its checkpointed blocks inside), inside FSDP's hooks:
            # gathered weights are parameters and are not copied. A split backward reads the
            # saved tensors in two tasks: it copies back as it reads (no prefetch).
            prefetch = not splits_backward(config.schedule, config.split_backward)
            apply_activation_offload(module, device, offload, prefetch)
    tied_weights = TiedWeights(tied, list(zip(stage_ids, modules, strict=True)), dims)
    merged = merge_stage_modules(modules)
    if meta or load_from is not None:
        source = Source(init or default_init(model), load_from, model, init is not None)
        fill_values(modules, merged, device, meta, source, tied_weights)
    return Built(modules, merged, tied_weights, call_inputs, plus, offload)


def rank_describer(mesh: Any, style: Any, config: ZeroPPLayout) -> Callable[[int], str]:
    """Any rank's name in messages (`describe_rank`, with that rank's stages)."""

    def describe(rank: int) -> str:
        coords = mesh_coordinates(mesh, rank)
        stages = stage_ids_for_rank(style, coords.get("pp", 0), config.pp_size, config.num_chunks)
        return describe_rank(mesh, stages, rank=rank)

    return describe


def _prepare_stage(
    module: nn.Module,
    stage_id: int,
    blocks: list[str],
    config: ZeroPPLayout,
    dims: ParallelDims,
    device: torch.device,
    meta: bool,
    plus: Plus,
    recompute_under: Any = None,
) -> None:
    """One stage moved to `device`, its blocks compiled and checkpointed as configured (their
    recomputation under `recompute_under`, the step's CP attention), sharded."""
    if meta:
        real_to(module, device)  # the rest is allocated once sharded
    else:
        module.to(device)
    if config.compile:  # inside the checkpoint, outside FSDP's hooks
        regions = splits_backward(config.schedule, config.split_backward)
        compile_blocks(module, blocks, regions=regions)
    if config.recomputes(stage_id):
        apply_activation_checkpointing(module, blocks, recompute_under)
    shard_stage(module, blocks, dims.dp_mesh, config, plus)


def _recast(model: nn.Module, dtype: torch.dtype | None) -> bool:
    """Whether the stages compute in another dtype than the model's floating parameters hold."""
    held = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return dtype is not None and bool(held - {dtype})
