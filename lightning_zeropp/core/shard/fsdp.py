"""Apply FSDP2 (`fully_shard`) and activation checkpointing to one pipeline stage.

Each block is its own FSDP unit (one all-gather per block, freed after use), and the stage root is a
unit for whatever lies outside the blocks (embeddings, final norm, head). Under pipeline parallelism
the default keeps weights unsharded between a stage's micro-batches (`reshard_after_forward=False`),
so a stage gathers once per step instead of once per micro-batch.

FSDP2 cannot shard a parameter with no dimension (CLIP's `logit_scale`): such parameters are left
whole on every rank (`ignored_params`), and the engine averages their gradients over the
data-parallel ranks itself (`core.step.grads.average_whole_grads`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.shard.plus import Plus

__all__ = ["shard_stage", "apply_activation_checkpointing", "local_shard"]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` (a view: writes reach a DTensor's storage); `t` if not sharded."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_stage(
    stage: nn.Module,
    block_names: Sequence[str],
    dp_mesh: DeviceMesh,
    config: ZeroPPLayout,
    plus: Plus | None = None,
) -> nn.Module:
    """`fully_shard` each block of `stage`, then the stage root, over `dp_mesh`; then ZeRO++'s
    collectives (`core.shard.plus`) on every unit."""
    # When the reduce dtype is not set, reduce in fp32 under low-precision params: summing bf16
    # gradients over many ranks loses the low bits FSDP users expect to keep.
    reduce_dtype = config.reduce_dtype
    if reduce_dtype is None and config.param_dtype is not None:
        reduce_dtype = torch.float32
    policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=reduce_dtype)
    plus = plus or Plus(config, dp_mesh.device_type)
    options = plus.options()
    units = [_find_block(stage, name) for name in block_names]
    whole = {p for p in stage.parameters() if p.dim() == 0}  # FSDP2 refuses them
    with plus.sharding():
        for block in units:
            fully_shard(block, mesh=dp_mesh, mp_policy=policy, ignored_params=whole, **options)
        fully_shard(stage, mesh=dp_mesh, mp_policy=policy, ignored_params=whole, **options)
    plus.install([*units, stage])  # type: ignore[list-item]  # fully_shard made them FSDPModules
    return stage


def apply_activation_checkpointing(
    stage: nn.Module, block_names: Sequence[str], recompute_under: Any = None
) -> None:
    """Recompute each block's activations in backward instead of keeping them.

    The block's `forward` is wrapped in place, so parameter names do not change (a wrapper module
    would add a prefix to every name and break name-based checkpoints). `recompute_under`: a
    context manager the recomputation must run under, as the forward ran (the engine's CP
    attention, a `TorchFunctionMode`): torch's checkpoint re-enters only a device context for
    it, and the backward does not carry the step's function modes.
    """
    options: dict[str, Any] = {"use_reentrant": False}
    if recompute_under is not None:
        options["context_fn"] = lambda: (contextlib.nullcontext(), recompute_under)
    for name in block_names:
        block = _find_block(stage, name)
        block.forward = functools.partial(checkpoint, block.forward, **options)


def _find_block(stage: nn.Module, name: str) -> nn.Module:
    try:
        return stage.get_submodule(name)
    except AttributeError as err:
        raise AssertionError(f"block {name!r} is not in its stage module") from err
