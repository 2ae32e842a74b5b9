"""Every use of a private torch name lives here, so a torch upgrade touches one file.

Covered torch range: 2.13.x (pinned in pyproject.toml).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fully_shard as _fully_shard_module
from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    REDUCE_GRAD,
    RESHARD,
    UNSHARD,
    _Action,
    _add_reduce_grad,
    _add_send_recv,
    _PipelineContext,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
)

from lightning_zeropp.core.zeropp_schedule import Task, gather_blocks

__all__ = [
    "LeanStage",
    "PipelineSchedule",
    "UnitScheduleRuntime",
    "on_scheduled_loss",
    "unsharded_parameter_bytes",
    "local_chunk",
    "fsdp_unit_shards",
    "defer_post_forward_reshard",
    "post_forward_mesh",
    "offload_policies",
    "release_to_post_forward_copy",
]

PipelineSchedule = _PipelineSchedule


class LeanStage(PipelineStage):
    """torch's `PipelineStage` whose shape inference holds one stage's gathered weights at a time.

    On its first step torch infers every stage's shapes by running one micro-batch forward through
    all of a rank's stages before any scheduled action; FSDP gathers each stage's weights for it
    and, without resharding after forward (the default when pp > 1), keeps all of them: a rank's
    whole share of the model unsharded at once, which is more than a large model's shards leave
    room for. This reshards each stage right after its forward inference; the backward inference
    that follows gathers again, one stage at a time, as a real backward does.
    """

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._prepare_forward_infra(*args, **kwargs)
        finally:
            for module in self.submod.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()


def on_scheduled_loss(schedule: _PipelineSchedule, wrapper: Callable[..., Any]) -> None:
    """Route the schedule's real per-micro-batch loss calls through `wrapper(compute, *args)`.

    The runtime also calls the loss function once, outside `_compute_loss`, to infer gradient
    shapes on the first step (and after each train/eval switch). Hooking `_compute_loss` tells the
    two apart, so side effects such as logging happen once per real micro-batch only.
    """
    compute = schedule._compute_loss

    def routed(output: Any, target: Any, loss_kwargs: dict[str, Any] | None = None) -> Any:
        return wrapper(compute, output, target, loss_kwargs)

    schedule._compute_loss = routed  # type: ignore[method-assign]


class UnitScheduleRuntime(_PipelineScheduleRuntime):
    """torch's schedule runtime executing explicit per-rank task orders (looped stage placement).

    The compute order comes from `core.zeropp_schedule`. Lowering: one UNSHARD (all-gather of every
    FSDP unit of the stage) before each contiguous block of one stage's tasks and one RESHARD after
    it, an early gradient reduce-scatter after the tasks listed in `reduce_at` (a REDUCE_GRAD action
    carrying a micro-batch index; torch's own end-of-step REDUCE_GRAD carries none), then torch's
    own passes add the end-of-step reduction and the send/recv actions.

    Two actions get their own implementation:
    - BACKWARD_WEIGHT on a stage whose weights were released (a held-back W) computes the weight
      gradients against FSDP's unsharded parameter objects, whose data is gone but whose autograd
      identity and `.grad` are kept: a weight gradient needs saved activations, not weights.
    - REDUCE_GRAD with a micro-batch index reduce-scatters the gradients gathered so far into the
      sharded gradients (which accumulate) and leaves the weights as they are; the end-of-step one
      is torch's, which also scales by the micro-batch count.
    """

    def __init__(
        self,
        stages: list[Any],
        n_microbatches: int,
        loss_fn: Callable[..., Any] | None,
        orders: Mapping[int, Sequence[Task]],
        reduce_at: Mapping[int, Sequence[int]] | None = None,
        stage_to_rank: Mapping[int, int] | None = None,
        forward_only: bool = False,
        keep_node_copy: bool = False,
    ) -> None:
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
        if stage_to_rank is not None:  # e.g. the V placement; the runtime assumes looped
            self.stage_index_to_group_rank = dict(stage_to_rank)
            for stage in self._stages:
                stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        kinds = {"F": FORWARD, "B": FULL_BACKWARD, "I": BACKWARD_INPUT, "W": BACKWARD_WEIGHT}
        self.pipeline_order = {
            rank: [_Action(t.stage, kinds[t.kind], t.microbatch) for t in order]
            for rank, order in orders.items()
        }
        reduce_at = reduce_at or {}
        lowered = {
            rank: _lower(orders[rank], actions, set(reduce_at.get(rank, ())), keep_node_copy)
            for rank, actions in self.pipeline_order.items()
        }
        if not forward_only:  # a forward-only order has no gradients to reduce
            lowered = {r: _add_reduce_grad(a, n_microbatches) for r, a in lowered.items()}
        mapping = self.stage_index_to_group_rank
        self.pipeline_order_with_comms = _add_send_recv(
            lowered, stage_to_rank=lambda s: mapping[s], num_stages=self._num_stages
        )
        self.register_custom_function(BACKWARD_WEIGHT, _backward_weight)
        self.register_custom_function(REDUCE_GRAD, _reduce_grad)
        if keep_node_copy:
            self.register_custom_function(UNSHARD, _gather)
            self.register_custom_function(RESHARD, _release)

    def evaluate(
        self, *args: Any, target: Any = None, losses: list | None = None, **kw: Any
    ) -> None:
        """Forward only, keeping no outputs: `eval()` would merge the last stage's outputs
        across micro-batches, which fails on a scalar among them (an HF output's loss)."""
        saved = self._has_backward
        self._has_backward = False
        try:
            self.step(*args, target=target, losses=losses, return_outputs=False, **kw)
        finally:
            self._has_backward = saved


# A RESHARD action whose micro-batch index is this releases to FSDP's post-forward copy (hpZ).
_TO_NODE_COPY = 0


def _lower(
    order: Sequence[Task], actions: list[_Action], reduce_at: set[int], keep_node_copy: bool
) -> list[_Action]:
    blocks = gather_blocks(order)
    starts = {start: stage for stage, start, _ in blocks}
    ends = {end - 1: stage for stage, _, end in blocks}
    # A release after forwards only, of a chunk that runs backward later, keeps the node copy.
    to_copy = {
        end - 1
        for n, (stage, start, end) in enumerate(blocks)
        if keep_node_copy
        and all(t.kind == "F" for t in order[start:end])
        and any(later == stage for later, _, _ in blocks[n + 1 :])
    }
    lowered: list[_Action] = []
    for i, (task, action) in enumerate(zip(order, actions, strict=True)):
        if i in starts:
            lowered.append(_Action(starts[i], UNSHARD))
        lowered.append(action)
        if i in reduce_at:
            lowered.append(_Action(task.stage, REDUCE_GRAD, task.microbatch))
        if i in ends:
            lowered.append(_Action(ends[i], RESHARD, _TO_NODE_COPY if i in to_copy else None))
    return lowered


def _gather(action: _Action, ctx: _PipelineContext) -> None:
    """UNSHARD as torch's runtime does it; once a gather from the post-forward copy has ended,
    that copy's mesh is hidden from FSDP again."""
    runtime = ctx.schedule_ref
    stage = _stage_of(runtime, action.stage_index)
    if not isinstance(stage.submod, FSDPModule):
        return
    assert stage.stage_index not in runtime.unsharded_stages, "gathered twice"
    assert stage.stage_index not in runtime.unshard_ops, "gathered twice"
    for module in stage.submod.modules():
        if isinstance(module, FSDPModule):
            handle = module.unshard(async_op=True)
            runtime.unshard_ops[stage.stage_index].append(_Gathered(handle, module))


class _Gathered:
    """An unshard handle that hides the post-forward copy's mesh once the gather is waited on."""

    def __init__(self, handle: Any, module: FSDPModule) -> None:
        self.handle, self.module = handle, module

    def wait(self) -> None:
        self.handle.wait()
        _hide_post_forward_mesh(self.module)


def _release(action: _Action, ctx: _PipelineContext) -> None:
    """RESHARD as torch's runtime does it, to the post-forward copy when the action says so."""
    runtime = ctx.schedule_ref
    stage = _stage_of(runtime, action.stage_index)
    if isinstance(stage.submod, FSDPModule):
        assert stage.stage_index in runtime.unsharded_stages, "released without a gather"
        assert stage.stage_index not in runtime.unshard_ops, "released before the gather ended"
        for module in stage.submod.modules():
            if not isinstance(module, FSDPModule):
                continue
            if action.microbatch_index == _TO_NODE_COPY:
                release_to_post_forward_copy(module)
            else:
                module.reshard()
        runtime.unsharded_stages.remove(stage.stage_index)


def _stage_of(runtime: Any, stage_index: int) -> Any:
    return next(s for s in runtime._stages if s.stage_index == stage_index)


def _backward_weight(action: _Action, ctx: _PipelineContext) -> None:
    runtime = ctx.schedule_ref
    stage = _stage_of(runtime, action.stage_index)
    runtime.backward_counter[stage.stage_index] += 1
    last = runtime.backward_counter[stage.stage_index] == runtime._n_microbatches
    gathered = stage.stage_index in runtime.unsharded_stages or stage.stage_index in (
        runtime.unshard_ops
    )
    if gathered or not isinstance(stage.submod, FSDPModule):
        runtime._assert_unsharded(stage)
        stage.backward_weight_one_chunk(action.microbatch_index, last_backward=last)
        return
    with _unsharded_parameters(stage.submod):
        stage.backward_weight_one_chunk(action.microbatch_index, last_backward=last)


@contextlib.contextmanager
def _unsharded_parameters(module: nn.Module) -> Iterator[None]:
    """Make `module.parameters()` yield FSDP's unsharded parameter objects while resharded.

    The stage computes weight gradients for (and accumulates them into) `submod.parameters()`;
    once resharded those are the sharded DTensors, which the saved autograd graph never saw.

    A weight's gradient never needs its own value when the weight enters its op once and linearly
    (matmuls, embeddings, norms), but some kernels still touch the memory: layer norm's backward
    reads the scale even when only the scale's gradient is wanted. Vectors (norm scales, biases;
    tiny) therefore get memory filled with NaN for the duration: read but unused it is harmless,
    used it poisons the gradients and the loss, so a model whose weight gradients do depend on the
    weights fails loudly instead of training on garbage. Matrices stay unallocated; a kernel that
    reads one fails with the error below.
    """
    params = [
        fsdp_param._unsharded_param
        for m in module.modules()
        if isinstance(m, FSDPModule) and (group := m._get_fsdp_state()._fsdp_param_group)
        for fsdp_param in group.fsdp_params
        if hasattr(fsdp_param, "_unsharded_param")
    ]
    filled = [p for p in params if p.ndim <= 1 and p.untyped_storage().size() == 0]
    for p in filled:
        p.untyped_storage().resize_((p.storage_offset() + p.numel()) * p.element_size())
        p.data.fill_(float("nan"))
    module.parameters = lambda recurse=True: iter(params)  # type: ignore[method-assign]
    try:
        yield
    except RuntimeError as err:
        if "data is not allocated" not in str(err):
            raise
        raise RuntimeError(
            "a held-back weight-gradient task (schedule='zeropp', split_backward=True) needed the "
            "values of a released weight matrix; this model's weight gradients depend on its "
            "weights. Use split_backward=False."
        ) from err
    finally:
        del module.parameters
        for p in filled:
            p.untyped_storage().resize_(0)


def _reduce_grad(action: _Action, ctx: _PipelineContext) -> None:
    runtime = ctx.schedule_ref
    stage = _stage_of(runtime, action.stage_index)
    if action.microbatch_index is None:  # torch's end-of-step reduction, as the runtime does it
        stage.perform_reduce_grad(runtime._n_microbatches if runtime.scale_grads else 1)
        return
    root = stage.submod
    if not isinstance(root, FSDPModule):
        return
    # What perform_reduce_grad does, minus resharding (the block may still be running) and minus
    # scaling (the end-of-step reduction scales everything once).
    root.set_requires_gradient_sync(True)
    root.set_reshard_after_backward(False)
    root.set_is_last_backward(True)
    state = root._get_fsdp_state()
    for sub in state._state_ctx.all_states:
        for group in sub._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
    root.set_requires_gradient_sync(False)
    root.set_is_last_backward(False)


def fsdp_unit_shards(module: FSDPModule) -> list[tuple[int, int]]:
    """(padded shard elements, parameter dims) of each parameter of one FSDP unit, in the order
    FSDP lays them out in its all-gather and reduce-scatter buffers."""
    return [
        (p.padded_sharded_param_size.numel(), len(p._orig_size))
        for group in module._get_fsdp_state()._fsdp_param_groups
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
    return [group.offload_policy for group in module._get_fsdp_state()._fsdp_param_groups]


def defer_post_forward_reshard(module: FSDPModule) -> None:
    """Keep the post-forward copy's mesh of a unit built with integer `reshard_after_forward`,
    but hide it from FSDP, whose post-forward hook would otherwise reshard after every forward:
    a schedule that releases weights itself decides when (`release_to_post_forward_copy`)."""
    for group in module._get_fsdp_state()._fsdp_param_groups:
        group._lzpp_post_forward_mesh_info = group.post_forward_mesh_info
        group.post_forward_mesh_info = None


def release_to_post_forward_copy(module: FSDPModule) -> None:
    """Release a gathered unit to its post-forward copy (each rank keeps 1/k of the weights; the
    next gather runs over those k ranks), as FSDP's own post-forward reshard does."""
    for group in module._get_fsdp_state()._fsdp_param_groups:
        info = getattr(group, "_lzpp_post_forward_mesh_info", None)
        if info is not None and group.is_unsharded:
            group.post_forward_mesh_info = info  # the next gather reads it; see gather_stage
            group._to_sharded_post_forward()
        else:
            group.reshard()


def _hide_post_forward_mesh(module: FSDPModule) -> None:
    for group in module._get_fsdp_state()._fsdp_param_groups:
        if hasattr(group, "_lzpp_post_forward_mesh_info"):
            group.post_forward_mesh_info = None


def local_chunk(tensor: Any) -> tuple[slice, ...]:
    """Where this rank's part of `tensor` lies in the whole tensor (all of it when it is not a
    DTensor): the index that cuts this rank's rows out of a whole copy."""
    create = getattr(tensor, "__create_chunk_list__", None)  # DTensor's, as DCP reads it
    if create is None:
        return tuple(slice(0, n) for n in tensor.shape)
    (chunk,) = create()
    return tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))


def unsharded_parameter_bytes(module: nn.Module) -> int:
    """Bytes of FSDP unsharded (gathered) parameters currently allocated under `module`."""
    total = 0
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group else ():
            param = getattr(fsdp_param, "_unsharded_param", None)
            if param is not None:
                total += param.untyped_storage().size()
    return total


def default_store() -> Any:
    """The c10d store the default process group rendezvoused on (shared by every rank)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


__all__ += ["default_store"]


def group_timeout(group: Any) -> timedelta | None:
    """The timeout `group`'s operations run under, as its first backend that tells reports it."""
    for device in group._device_types:
        try:
            timeout = getattr(group._get_backend(device).options, "_timeout", None)
        except (RuntimeError, AttributeError):  # no backend for this device, or no options
            continue
        if timeout is not None:
            return timeout
    return None


def mesh_group_options(device_type: str, timeout: timedelta) -> Any | None:
    """Backend options that make `init_device_mesh(backend_override=...)` create a dimension's
    groups with `timeout` (None for device types other than "cpu" and "cuda": torch's default).

    A group's timeout must be given when it is created: gloo's point-to-point receives wait on
    the connection context's timeout, which a later `ProcessGroup.set_timeout` does not change.
    NCCL groups need NCCL's own options class; gloo ignores the object beyond its timeout.
    """
    if device_type == "cuda" and dist.is_nccl_available():
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False  # torch's default for groups it creates
        options._timeout = timeout
        return options
    if device_type == "cpu":
        return dist.ProcessGroupGloo.Options("gloo", timeout)
    return None


__all__ += ["group_timeout", "mesh_group_options"]
