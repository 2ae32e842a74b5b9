"""FSDP2's internals: parameter groups and their unsharded copies, post-backward and
post-forward resharding (`core.shard`, `core.schedule.runtime`, `core.measure`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fully_shard as _fully_shard_module
from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState as _TrainingState

from lightning_zeropp.core._torch_private.version import at_least

# torch 2.12 keeps a list of parameter groups per FSDP state (`_fsdp_param_groups`: one per mesh
# when parameters are given per-parameter meshes); 2.11 keeps one (`_fsdp_param_group`, or None
# for a unit without parameters of its own).
GROUP_LIST = at_least(2, 12)

__all__ = [
    "defer_post_forward_reshard",
    "fill_missing_gradients",
    "fsdp_pre_backward_muted",
    "fsdp_unit_shards",
    "hide_post_forward_mesh",
    "is_gathered",
    "offload_policies",
    "post_forward_mesh",
    "release_to_post_forward_copy",
    "run_post_backward",
    "unsharded_gradient_bytes",
    "unsharded_parameter_bytes",
    "unsharded_params",
]


def unsharded_params(module: FSDPModule) -> list[Any]:
    """FSDP's unsharded parameter objects of one unit (their data may be freed)."""
    group = module._get_fsdp_state()._fsdp_param_group
    params = (getattr(p, "_unsharded_param", None) for p in (group.fsdp_params if group else ()))
    return [p for p in params if p is not None]


def is_gathered(module: FSDPModule) -> bool:
    """Whether FSDP holds one unit's parameters unsharded (gathered) now."""
    return any(group.is_unsharded for group in _param_groups(module))


def run_post_backward(root: FSDPModule) -> None:
    """FSDP's post-backward of every unit under `root`, then its end-of-backward callback: the
    reduce-scatter of the gradients computed so far."""
    state = root._get_fsdp_state()
    for sub in state._state_ctx.all_states:
        for group in _state_groups(sub):
            group.post_backward()
    state._root_post_backward_final_callback()


def fill_missing_gradients(root: FSDPModule) -> None:
    """Collective over each unit's data-parallel ranks: before FSDP reduces the gradients of the
    units under `root`, a parameter that has a gradient on some data-parallel rank and none on
    this one (an expert no row of this rank's batch was routed to) gets a zero gradient here.

    FSDP's post-backward reduce-scatters only the parameters that hold a gradient, so ranks
    disagreeing on which do send buffers of different sizes (gloo: "40 vs 20" bytes; torch issue
    158719). Zeros are what this rank's rows contribute to the global batch's gradient; a
    parameter without a gradient on every rank keeps none, as in one process (an optimizer
    skips it there, and here).
    """
    # One all-reduce per data-parallel group, over every unit's flags (units share their mesh).
    by_mesh: dict[tuple[Any, ...], list[Any]] = {}
    for sub in root._get_fsdp_state()._state_ctx.all_states:
        for group in _state_groups(sub):
            info = group.mesh_info
            groups = tuple(
                getattr(info, name, None)
                for name in ("shard_process_group", "replicate_process_group")
            )
            by_mesh.setdefault((*groups, group.device), []).extend(
                fp for fp in group.fsdp_params
                if hasattr(fp, "_unsharded_param") and fp.sharded_param.requires_grad
            )  # fmt: skip
    for (*_groups, device), params in by_mesh.items():
        groups = tuple(_groups)
        if not params or all(pg is None or dist.get_world_size(pg) == 1 for pg in groups):
            continue
        mine = [
            fp.unsharded_accumulated_grad is not None or fp.unsharded_param.grad is not None
            for fp in params
        ]
        anywhere = torch.tensor(mine, dtype=torch.int32, device=device)
        for pg in groups:
            if pg is not None and dist.get_world_size(pg) > 1:
                dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=pg)
        if all(mine):  # nothing to fill here (a dense model): the peers' answer is not read, so
            continue  # no host sync
        for fp, held, some in zip(params, mine, anywhere.tolist(), strict=True):
            if some and not held:
                fp.unsharded_param.grad = torch.zeros_like(fp.unsharded_param)


@contextlib.contextmanager
def fsdp_pre_backward_muted(root: nn.Module) -> Iterator[None]:
    """While active, FSDP's pre-backward hooks of the units under `root` do nothing.

    A held-back weight-gradient task of a released chunk starts its autograd pass at the nodes
    where weight paths branch off; when such a node is a unit's output (a block ending in a
    norm: post-norm transformers), FSDP's pre-backward hook on that output runs again and would
    gather the released weights and queue its end-of-backward callback. Marking every parameter
    group as already in pre-backward, and the callback as queued, makes the hook a no-op."""
    states = [m._get_fsdp_state() for m in root.modules() if isinstance(m, FSDPModule)]
    saved = [
        (st, st._training_state, st._state_ctx.post_backward_final_callback_queued,
         [(g, g._training_state) for g in _state_groups(st)])
        for st in states
    ]  # fmt: skip
    for st in states:
        st._state_ctx.post_backward_final_callback_queued = True
        for group in _state_groups(st):
            group._training_state = _TrainingState.PRE_BACKWARD
    try:
        yield
    finally:
        for st, training, queued, groups in saved:
            st._training_state = training
            st._state_ctx.post_backward_final_callback_queued = queued
            for group, state in groups:
                group._training_state = state


def _param_groups(module: FSDPModule) -> list[Any]:
    """FSDP's parameter groups of one unit (one, unless parameters were given per-param meshes)."""
    return _state_groups(module._get_fsdp_state())


def _state_groups(state: Any) -> list[Any]:
    if GROUP_LIST:
        return state._fsdp_param_groups
    group = state._fsdp_param_group
    return [group] if group is not None else []


def fsdp_unit_shards(module: FSDPModule) -> list[tuple[int, int]]:
    """(padded shard elements, parameter dims) of each parameter of one FSDP unit, in the order
    FSDP lays them out in its all-gather and reduce-scatter buffers."""
    return [
        (p.padded_sharded_param_size.numel(), len(p._orig_size))
        for group in _param_groups(module)
        for p in group.fsdp_params
    ]


@contextlib.contextmanager
def post_forward_mesh(mesh: DeviceMesh | None) -> Iterator[None]:
    """While active, `fully_shard(reshard_after_forward=k)` keeps its post-forward copy over the
    groups of `mesh`'s second dimension (k consecutive ranks) instead of building a new mesh.

    FSDP2 builds a DeviceMesh from the unit's own shard group on every call: its process groups
    are created by the ranks of that group only, under names that count calls, so with pipeline
    stages (each building a different mesh) the names collide across stages and the creation
    hangs; it also creates new groups per unit. One mesh over the whole world, created alike by
    every rank, serves every unit.
    """
    if mesh is None:
        yield
        return
    original = _fully_shard_module._get_post_forward_mesh_info

    def fixed(reshard_after_forward: bool | int, mesh_info: Any) -> Any:
        if isinstance(reshard_after_forward, bool) or reshard_after_forward != mesh.size(1):
            return original(reshard_after_forward, mesh_info)
        if mesh_info.shard_mesh_size % reshard_after_forward:
            raise AssertionError(f"{reshard_after_forward} does not divide the shard group")
        return HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)

    _fully_shard_module._get_post_forward_mesh_info = fixed
    try:
        yield
    finally:
        _fully_shard_module._get_post_forward_mesh_info = original


def offload_policies(module: FSDPModule) -> list[Any]:
    """The offload policy of each parameter group of one FSDP unit."""
    return [group.offload_policy for group in _param_groups(module)]


def defer_post_forward_reshard(module: FSDPModule) -> None:
    """Keep the post-forward copy's mesh of a unit built with integer `reshard_after_forward`,
    but hide it from FSDP, whose post-forward hook would otherwise reshard after every forward:
    a schedule that releases weights itself decides when (`release_to_post_forward_copy`)."""
    for group in _param_groups(module):
        group._lzpp_post_forward_mesh_info = group.post_forward_mesh_info
        group.post_forward_mesh_info = None


def release_to_post_forward_copy(module: FSDPModule) -> None:
    """Release a gathered unit to its post-forward copy (each rank keeps 1/k of the weights; the
    next gather runs over those k ranks), as FSDP's own post-forward reshard does."""
    for group in _param_groups(module):
        info = getattr(group, "_lzpp_post_forward_mesh_info", None)
        if info is not None and group.is_unsharded:
            group.post_forward_mesh_info = info  # the next gather reads it (core.runtime)
            group._to_sharded_post_forward()
        else:
            group.reshard()


def hide_post_forward_mesh(module: FSDPModule) -> None:
    """Hide a deferred unit's post-forward mesh from FSDP again (`defer_post_forward_reshard`)."""
    for group in _param_groups(module):
        if hasattr(group, "_lzpp_post_forward_mesh_info"):
            group.post_forward_mesh_info = None


def unsharded_parameter_bytes(module: nn.Module) -> int:
    """Bytes of FSDP unsharded (gathered) parameters currently allocated under `module`."""
    return sum(
        p.untyped_storage().size()
        for m in module.modules()
        if isinstance(m, FSDPModule)
        for p in unsharded_params(m)
    )


def unsharded_gradient_bytes(module: nn.Module) -> int:
    """Bytes of FSDP's unsharded gradients under `module` not yet reduce-scattered: those autograd
    wrote into the unsharded parameters, and those FSDP accumulates in the reduce dtype."""
    total = 0
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        for p in group.fsdp_params if group else ():
            param = getattr(p, "_unsharded_param", None)
            for grad in (getattr(param, "grad", None), p.unsharded_accumulated_grad):
                if grad is not None:
                    total += grad.numel() * grad.element_size()
    return total
