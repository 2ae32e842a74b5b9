"""Memory per rank, predicted: model state (parameters, gradients, optimizer state) and the most
weight bytes gathered at once.

Model state is exact arithmetic on the parameters each stage holds: FSDP2 shards every parameter
along dim 0 in chunks of ceil(rows / dp_shard) (the last ranks' chunks shorter or empty), in the
parameter's own dtype; gradients take the same; AdamW keeps two moments of the same size plus a
4-byte step per parameter, SGD without momentum nothing. With `cpu_offload` all of it lives in
host memory. The model may be built on the meta device: only shapes and dtypes are read.

Gathered weights, per schedule (in the compute dtype, `param_dtype` if set):
- torch's pipeline schedules keep every stage of the rank gathered for the whole step (no
  resharding after forward, the default with pp > 1): the sum of the rank's stages;
- `schedule="zeropp"` gathers one chunk per block of work: the largest of the rank's stages;
- FSDP alone (pp 1) keeps the root unit (embeddings, norms, head) gathered through the step and
  gathers the blocks one by one: the root plus the largest block where collectives run in
  order (gloo, CPU); on CUDA FSDP2 issues the next block's gather before the last is freed, so
  the root plus the two largest consecutive blocks (not checked here: no GPU in CI). With
  several micro-batches, gradient accumulation keeps every backward's weights gathered until the
  last: the whole model.
Under context parallelism (`cp_size`) FSDP shards over dp_shard x cp (`plan.context.fsdp_view`).
A shard group of one rank still gathers (FSDP2 keeps its unsharded copy apart).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.settings.placement import schedule_style, stage_ids_for_rank
from lightning_zeropp.core.split.blocks import find_blocks, plan_blocks
from lightning_zeropp.core.split.methods import split_model
from lightning_zeropp.plan.context import fsdp_view

__all__ = [
    "RankMemoryPlan",
    "predict_memory",
    "split_stages",
    "stage_blocks",
    "stage_parameter_shapes",
    "stage_ranges",
    "stage_units",
]

ParamShape = tuple[tuple[int, ...], int]  # (shape, bytes per element)


@dataclass(frozen=True)
class RankMemoryPlan:
    """Predicted bytes of one rank (global rank `rank`)."""

    rank: int
    parameters: int
    gradients: int
    optimizer_state: int
    gathered_peak: int
    on_host: bool  # model state offloaded to host memory (`cpu_offload`)

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


def split_stages(model: nn.Module, config: ZeroPPLayout) -> list[nn.Module]:
    """The stage modules the engine builds from `model` (a resolved config), in their own dtype;
    the model itself when there is one stage."""
    if config.num_stages == 1:
        return [model]
    plan = plan_blocks(model, config.num_stages, config.split_points)
    return split_model(model, plan, range(config.num_stages), "stack")


def stage_ranges(model: nn.Module, config: ZeroPPLayout) -> list[range]:
    """Each stage's block indices (a resolved config); cached per model and cut (a search asks
    for the same cut many times, and balancing counts every parameter)."""
    points = tuple(config.split_points) if config.split_points else None
    return list(_stage_ranges(model, config.num_stages, points))


@functools.lru_cache(maxsize=256)
def _stage_ranges(
    model: nn.Module, num_stages: int, points: tuple[int, ...] | None
) -> tuple[range, ...]:
    if num_stages == 1:
        return (range(len(model_blocks(model)[1])),)
    return tuple(plan_blocks(model, num_stages, list(points) if points else None).ranges)


@functools.lru_cache(maxsize=64)
def model_blocks(model: nn.Module) -> tuple[str, list[str]]:
    """`core.split.find_blocks` of `model`, cached (it walks every module)."""
    return find_blocks(model)


def stage_blocks(model: nn.Module, config: ZeroPPLayout) -> tuple[str, list[list[str]]]:
    """The blocks' container in `model` and each stage's block names (a resolved config)."""
    container, names = model_blocks(model)
    return container, [[names[i] for i in r] for r in stage_ranges(model, config)]


Shapes = list[tuple[int, ...]]


@dataclass(frozen=True)
class StageUnits:
    """A stage's parameters as the engine splits the model: all of them, and by FSDP unit."""

    params: list[ParamShape]
    blocks: list[Shapes]  # each block's parameter shapes
    rest: Shapes  # the stage root's own (everything outside its blocks)


def stage_units(model: nn.Module, config: ZeroPPLayout) -> list[StageUnits]:
    """Each stage's parameters and FSDP units (a resolved config); cached per model and cut,
    since a search asks for the same ones many times."""
    points = tuple(config.split_points) if config.split_points else None
    return _stage_units(model, config.num_stages, points)


@functools.lru_cache(maxsize=64)
def _stage_units(
    model: nn.Module, num_stages: int, points: tuple[int, ...] | None
) -> list[StageUnits]:
    cut = ZeroPPConfig(
        pp_size=num_stages,
        dp_shard_size=1,
        split_points=list(points) if points else None,
        node_size=num_stages,  # given: not the launcher's LOCAL_WORLD_SIZE
    )
    cfg = cut.resolve(num_stages)
    container, blocks = stage_blocks(model, cfg)
    out = []
    for stage, names in zip(split_stages(model, cfg), blocks, strict=True):
        holder = stage.get_submodule(container) if container else stage
        units = [[tuple(p.shape) for p in holder.get_submodule(n).parameters()] for n in names]
        inside = {id(p) for n in names for p in holder.get_submodule(n).parameters()}
        rest = [tuple(p.shape) for p in stage.parameters() if id(p) not in inside]
        params = [(tuple(p.shape), p.element_size()) for p in stage.parameters()]
        out.append(StageUnits(params, units, rest))
    return out


def stage_parameter_shapes(model: nn.Module, config: ZeroPPLayout) -> list[list[ParamShape]]:
    """Each stage's parameters as the engine splits `model` (a resolved config)."""
    return [units.params for units in stage_units(model, config)]


def local_numel(shape: Sequence[int], shards: int, index: int) -> int:
    """Elements of shard `index` of a parameter FSDP2 shards along dim 0 over `shards` ranks."""
    if not shape:
        return 1 if index == 0 else 0
    chunk = math.ceil(shape[0] / shards)
    rows = max(0, min(chunk, shape[0] - index * chunk))
    return rows * math.prod(shape[1:])


def predict_memory(
    model: nn.Module,
    config: ZeroPPConfig | ZeroPPLayout,
    world_size: int,
    optimizer: str = "adamw",
    device_type: str = "cuda",
) -> list[RankMemoryPlan]:
    """Every rank's predicted memory for `model` under `config` (resolved here) on
    `device_type` ("cuda", or "cpu" for gloo ranks)."""
    if optimizer not in ("adamw", "adam", "sgd"):
        raise ValueError(f"optimizer={optimizer!r} is not modelled; use 'adamw', 'adam' or 'sgd'.")
    cfg = fsdp_view(config.resolve(world_size))  # under CP, FSDP shards over dp_shard x cp
    stages = stage_parameter_shapes(model, cfg)
    compute_bytes = cfg.param_dtype.itemsize if cfg.param_dtype else None
    style = schedule_style(cfg.schedule)
    full = [sum(math.prod(s) * (compute_bytes or b) for s, b in stage) for stage in stages]
    held = {
        r: tuple(stage_ids_for_rank(style, r, cfg.pp_size, cfg.num_chunks))
        for r in range(cfg.pp_size)
    }
    peaks = {
        r: _gathered_peak(model, cfg, list(held[r]), full, compute_bytes, device_type)
        for r in range(cfg.pp_size)
    }
    out = []
    points = tuple(cfg.split_points) if cfg.split_points else None
    shard_bytes: dict[tuple[int, int], tuple[int, int]] = {}  # replicas hold the same shards
    for rank in range(world_size):
        pp_rank, shard = divmod(rank, cfg.dp_replicate_size * cfg.dp_shard_size)
        shard %= cfg.dp_shard_size
        ids = held[pp_rank]
        if (pp_rank, shard) not in shard_bytes:
            shard_bytes[pp_rank, shard] = _shard_bytes(
                model, cfg.num_stages, points, ids, cfg.dp_shard_size, shard
            )
        params, count = shard_bytes[pp_rank, shard]
        state = 2 * params + 4 * count if optimizer != "sgd" else 0
        out.append(
            RankMemoryPlan(
                rank=rank,
                parameters=params,
                gradients=params,
                optimizer_state=state,
                gathered_peak=peaks[pp_rank],
                on_host=cfg.cpu_offload,
            )
        )
    return out


@functools.lru_cache(maxsize=4096)
def _shard_bytes(
    model: nn.Module,
    num_stages: int,
    points: tuple[int, ...] | None,
    ids: tuple[int, ...],
    shards: int,
    index: int,
) -> tuple[int, int]:
    """Bytes of shard `index` of stages `ids` over `shards` ranks, and their parameter count."""
    held = [(s, b) for i in ids for s, b in _stage_units(model, num_stages, points)[i].params]
    return sum(local_numel(s, shards, index) * b for s, b in held), len(held)


def _gathered_peak(
    model: nn.Module,
    cfg: ZeroPPLayout,
    ids: list[int],
    full: list[int],
    compute: int | None,
    device_type: str,
) -> int:
    if cfg.num_stages == 1:
        bytes_per = compute or next(model.parameters()).element_size()
        (units,) = stage_units(model, cfg)
        block_shapes, root_shapes = units.blocks, units.rest
        blocks = [sum(math.prod(s) for s in b) * bytes_per for b in block_shapes]
        root = sum(math.prod(s) for s in root_shapes) * bytes_per
        if cfg.num_microbatches > 1:  # accumulation keeps each backward's weights gathered
            return root + sum(blocks)
        if device_type != "cuda":
            return root + max(blocks, default=0)
        return root + max(a + b for a, b in zip(blocks, [*blocks[1:], 0], strict=True))
    if cfg.schedule == "zeropp":
        return max(full[i] for i in ids)
    return sum(full[i] for i in ids)
