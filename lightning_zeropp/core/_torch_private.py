"""Every use of a private torch name lives here, so a torch upgrade touches one file.

Covered torch range: 2.13.x (pinned in pyproject.toml).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fully_shard as _fully_shard_module
from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState as _TrainingState
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_reduce_grad,
    _add_send_recv,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
)

__all__ = [
    "fsdp_pre_backward_muted",
    "ShapeInferenceStage",
    "PipelineSchedule",
    "ScheduleRuntime",
    "Action",
    "add_reduce_grad",
    "add_send_recv",
    "runtime_stages",
    "runtime_num_stages",
    "runtime_microbatches",
    "runtime_has_backward",
    "set_runtime_has_backward",
    "wait_gathered",
    "traced_dtype_checks",
    "unsharded_params",
    "run_post_backward",
    "hide_post_forward_mesh",
    "on_scheduled_loss",
    "is_gathered",
    "unsharded_parameter_bytes",
    "local_chunk",
    "fsdp_unit_shards",
    "defer_post_forward_reshard",
    "post_forward_mesh",
    "offload_policies",
    "storage_identity",
    "fused_attention",
    "release_to_post_forward_copy",
    "compile_errors",
    "inductor",
    "split_graph",
    "compile_split_graph",
    "keep_graph_compatible_backward",
    "set_compile_threads",
    "aot_eager",
    "stage_backward_input",
    "stage_backward_weight",
]

PipelineSchedule = _PipelineSchedule


class ShapeInferenceStage(PipelineStage):
    """torch's `PipelineStage` calling `after_forward_inference()` once its first-step forward
    shape inference (`_prepare_forward_infra`) has run (`core.schedule.runtime.LeanStage`)."""

    # Set by the engine: times shape inference (`core.measure.planning.PlanningStats.timed`).
    inference_clock: Any = None

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with self._timed():
            try:
                return super()._prepare_forward_infra(*args, **kwargs)
            finally:
                self.after_forward_inference()

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with self._timed():
            return super()._prepare_backward_infra(*args, **kwargs)

    def _timed(self) -> Any:
        clock = self.inference_clock
        return clock.timed() if clock is not None else contextlib.nullcontext()

    def after_forward_inference(self) -> None:
        """Called after forward shape inference (default: nothing)."""


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


# The schedule runtime's private names and state, for `core.schedule.runtime`.
Action = _Action
ScheduleRuntime = _PipelineScheduleRuntime
add_reduce_grad = _add_reduce_grad
add_send_recv = _add_send_recv


def runtime_stages(runtime: Any) -> list[Any]:
    return runtime._stages


def runtime_num_stages(runtime: Any) -> int:
    return runtime._num_stages


def runtime_microbatches(runtime: Any) -> int:
    return runtime._n_microbatches


def runtime_has_backward(runtime: Any) -> bool:
    return runtime._has_backward


def set_runtime_has_backward(runtime: Any, value: bool) -> None:
    runtime._has_backward = value


def wait_gathered(runtime: Any, stage: Any) -> None:
    """Wait for the stage's pending gather, as the runtime does before computing on it."""
    runtime._assert_unsharded(stage)


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
        for group in sub._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


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
         [(g, g._training_state) for g in st._fsdp_param_groups])
        for st in states
    ]  # fmt: skip
    for st in states:
        st._state_ctx.post_backward_final_callback_queued = True
        for group in st._fsdp_param_groups:
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
    return module._get_fsdp_state()._fsdp_param_groups


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


def storage_identity(tensor: Any) -> int:
    """An id of the storage under `tensor`, shared by its views, for meta tensors too (whose
    storages have no address)."""
    return tensor.untyped_storage()._cdata


def fused_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    **_: Any,
) -> Any:
    """`scaled_dot_product_attention` through the fused (flash) kernel, which saves the inputs,
    the output and a log-sum-exp row, as fused kernels do on a GPU. On the meta device the public
    function always takes the math path, which saves the whole attention matrix."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0]


def fused_attention_flops() -> dict[Any, Any]:
    """`FlopCounterMode(custom_mapping=...)` for `fused_attention`'s CPU kernel, which torch's
    counter does not know: the two matmuls of attention (scores, then weighted values)."""
    import torch

    def flops(q: Any, k: Any, v: Any, *_: Any, **__: Any) -> int:
        b, h, s, d = q
        return 2 * b * h * s * k[-2] * d + 2 * b * h * s * k[-2] * v[-1]

    return {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: flops}


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


def default_store() -> Any:
    """The c10d store the default process group rendezvoused on (shared by every rank)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


__all__ += ["default_store", "unsharded_gradient_bytes"]


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


def traced_dtype_checks(module: nn.Module) -> list[Any]:
    """The dtypes a traced graph (and the graphs of its submodules) asserts its tensors have:
    torch.export records a cast that was a no-op when traced (`x.to(torch.float32)` on a float32
    tensor) as `aten._assert_tensor_metadata`, not as a cast."""
    found = []
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        for node in graph.nodes if graph is not None else ():
            if node.op == "call_function" and "_assert_tensor_metadata" in str(node.target):
                found.append(node.kwargs.get("dtype"))
    return found


def is_dcp_metadata_global(module: str, name: str) -> bool:
    """Whether a distributed checkpoint's `.metadata` pickle may name `module.name`: DCP's own
    metadata classes (some private: `filesystem._StorageInfo`), torch's dtypes, `torch.Size`
    and layouts, and the path DCP records; nothing that runs code of the pickle's choosing."""
    import torch

    if module == "torch.distributed.checkpoint.metadata":
        return True
    if (module, name) in {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint.planner", "LoadItemType"),
        ("torch.distributed.checkpoint.planner", "WriteItemType"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }:
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def dcp_write_prefix(plan: Any) -> str:
    """The file-name prefix DCP's filesystem writer gives one rank's files (`__3_`), from the
    rank's save plan (its `storage_data`, a private `_StoragePrefix`)."""
    return plan.storage_data.prefix


def dcp_written_files(results: Any) -> list[str]:
    """The files one rank's DCP write results name (their private `_StorageInfo`)."""
    return sorted({str(r.storage_data.relative_path) for r in results})


__all__ += ["dcp_write_prefix", "dcp_written_files", "is_dcp_metadata_global"]


# ---------------------------------------------------------------- torch.compile (core.shard.compile)
# Imported on first use: torch._dynamo and torch._inductor take seconds to import.


def compile_errors() -> tuple[type[BaseException], ...]:
    """What torch.compile raises when it cannot compile a frame (tracing or backend failures),
    before any of the frame's compiled code has run."""
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import InductorError

    return (TorchDynamoException, InductorError)


def inductor(gm: Any, example_inputs: list[Any]) -> Any:
    """Inductor on one graph, its backward lowered now rather than at the first backward (so a
    failure surfaces in the forward, where the block can still fall back to eager)."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    with functorch_config.patch(force_non_lazy_backward_lowering=True):
        return compile_fx(gm, example_inputs)


def aot_eager(gm: Any, example_inputs: list[Any]) -> Any:
    """AOTAutograd without code generation: the autograd nodes `inductor`'s graphs make, run by
    torch's own kernels (checks of how graphs are cut, without the compile time)."""
    from torch._dynamo.backends.debugging import aot_eager as _aot_eager

    return _aot_eager(gm, example_inputs)


def split_graph(gm: Any, partition: Callable[[Any], int]) -> Any:
    """`gm` cut into one submodule (`submod_<k>`) per partition id `partition(node)`."""
    from torch.fx.passes.split_module import split_module

    return split_module(gm, None, partition)


def compile_split_graph(split: Any, example_inputs: list[Any], compile_fn: Callable) -> Any:
    """Compile each submodule of `split` with `compile_fn(submodule, example_inputs)` (which may
    return it as is, to run eagerly), propagating fake tensors from one to the next: what
    torch's DDPOptimizer does with the graph it cuts at bucket boundaries, each piece becoming
    its own autograd node."""
    import torch
    from torch._dynamo.backends.distributed import SubmodCompiler
    from torch._dynamo.utils import _disable_saved_tensors_hooks_during_tracing
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode(example_inputs) or torch._subclasses.FakeTensorMode()
    with _disable_saved_tensors_hooks_during_tracing():
        SubmodCompiler(split, compile_fn, fake_mode).run(*example_inputs)
    split.recompile()
    return split


def keep_graph_compatible_backward() -> None:
    """Let compiled backwards run under `retain_graph=True`, as a split backward's input-gradient
    task runs them (the weight-gradient task reads the graph after it). Process-wide: AOTAutograd
    reads this flag when each backward runs, and a backward compiled with donated buffers (which
    reuses saved activations' memory for its outputs) refuses to run with the graph kept."""
    from torch._functorch import config as functorch_config

    functorch_config.donated_buffer = False


def set_compile_threads(threads: int) -> None:
    """Inductor's compile workers: 1 compiles in the calling process (no worker pool to start;
    what ranks sharing a few cores want)."""
    from torch._inductor import config as inductor_config

    inductor_config.compile_threads = threads
