"""torch's pipelining runtime, adapted: a lean stage and the runtime of ZeroPP's unit schedule.

`LeanStage` holds one stage's gathered weights at a time during torch's first-step shape
inference. `UnitScheduleRuntime` executes a plan lowered by `core.schedule.zeropp.lower` (the
same lowering the pictures and the planner read) on torch's schedule runtime. Private torch
names are reached through `core._torch_private` only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    REDUCE_GRAD,
    RESHARD,
    UNSHARD,
)
from torch.distributed.tensor import DTensor

from lightning_zeropp.core import _torch_private as tp
from lightning_zeropp.core.schedule.zeropp import Step

__all__ = ["LeanStage", "UnitScheduleRuntime", "torch_actions"]


class LeanStage(tp.ShapeInferenceStage):
    """torch's `PipelineStage` whose shape inference holds one stage's gathered weights at a time.

    On its first step torch infers every stage's shapes by running one micro-batch forward through
    all of a rank's stages before any scheduled action; FSDP gathers each stage's weights for it
    and, without resharding after forward (the default when pp > 1), keeps all of them: a rank's
    whole share of the model unsharded at once, which is more than a large model's shards leave
    room for. This reshards each stage right after its forward inference; the backward inference
    that follows gathers again, one stage at a time, as a real backward does.
    """

    def after_forward_inference(self) -> None:
        for module in self.submod.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        # Data-parallel ranks must agree on which parameters have gradients (see
        # `fill_missing_gradients`): an expert none of a rank's rows was routed to has none.
        if isinstance(self.submod, FSDPModule):
            tp.fill_missing_gradients(self.submod)
        super().perform_reduce_grad(grad_scale_factor)


_KINDS = {"F": FORWARD, "B": FULL_BACKWARD, "I": BACKWARD_INPUT, "W": BACKWARD_WEIGHT}
# A RESHARD action whose micro-batch index is this releases to FSDP's post-forward copy (hpZ).
_TO_NODE_COPY = 0


def torch_actions(steps: Sequence[Step]) -> list[Any]:
    """A lowered plan as torch's runtime actions (before torch adds sends, receives and the
    end-of-step reduction)."""
    out = []
    for step in steps:
        if step.kind == "gather":
            out.append(tp.Action(step.stage, UNSHARD))
        elif step.kind == "release":
            out.append(tp.Action(step.stage, RESHARD, _TO_NODE_COPY if step.node_copy else None))
        else:
            assert step.task is not None
            kind = REDUCE_GRAD if step.kind == "reduce" else _KINDS[step.task.kind]
            out.append(tp.Action(step.stage, kind, step.task.microbatch))
    return out


class UnitScheduleRuntime(tp.ScheduleRuntime):
    """torch's schedule runtime executing explicit per-rank task orders (looped stage placement).

    `plans` are the ranks' lowered plans (`core.schedule.zeropp.lower`: compute tasks, gathers,
    releases, early reductions); torch's own passes add the end-of-step reduction and the
    sends/receives.
    Actions with their own implementation:
    - BACKWARD_WEIGHT on a stage whose weights were released (a held-back W) computes the weight
      gradients against FSDP's unsharded parameter objects, whose data is gone but whose autograd
      identity and `.grad` are kept: a weight gradient needs saved activations, not weights.
    - REDUCE_GRAD with a micro-batch index reduce-scatters the gradients gathered so far into the
      sharded gradients (which accumulate) and leaves the weights as they are; the end-of-step one
      is torch's, which also scales by the micro-batch count.
    - with hpZ (a plan with node-copy releases), UNSHARD and RESHARD: such a release keeps the
      node copy, and the gather that reads it hides it from FSDP again once done.
    """

    def __init__(
        self,
        stages: list[Any],
        n_microbatches: int,
        loss_fn: Callable[..., Any] | None,
        plans: Mapping[int, Sequence[Step]],
        stage_to_rank: Mapping[int, int] | None = None,
        forward_only: bool = False,
    ) -> None:
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
        if stage_to_rank is not None:  # e.g. the V placement; the runtime assumes looped
            self.stage_index_to_group_rank = dict(stage_to_rank)
            for stage in tp.runtime_stages(self):
                stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        self.plans = {rank: list(plan) for rank, plan in plans.items()}
        lowered = {rank: torch_actions(plan) for rank, plan in self.plans.items()}
        self.pipeline_order = {
            rank: [a for a in actions if a.computation_type in _KINDS.values()]
            for rank, actions in lowered.items()
        }
        if not forward_only:  # a forward-only order has no gradients to reduce
            lowered = {r: tp.add_reduce_grad(a, n_microbatches) for r, a in lowered.items()}
        mapping = self.stage_index_to_group_rank
        self.pipeline_order_with_comms = tp.add_send_recv(
            lowered, stage_to_rank=lambda s: mapping[s], num_stages=tp.runtime_num_stages(self)
        )
        self.register_custom_function(BACKWARD_WEIGHT, _backward_weight)
        self.register_custom_function(REDUCE_GRAD, _reduce_grad)
        if any(step.node_copy for plan in self.plans.values() for step in plan):
            self.register_custom_function(UNSHARD, _gather)
            self.register_custom_function(RESHARD, _release)

    def evaluate(
        self, *args: Any, target: Any = None, losses: list | None = None, **kw: Any
    ) -> None:
        """Forward only, keeping no outputs: `eval()` would merge the last stage's outputs
        across micro-batches, which fails on a scalar among them (an HF output's loss)."""
        saved = tp.runtime_has_backward(self)
        tp.set_runtime_has_backward(self, False)
        try:
            self.step(*args, target=target, losses=losses, return_outputs=False, **kw)
        finally:
            tp.set_runtime_has_backward(self, saved)


def _stage_of(runtime: Any, stage_index: int) -> Any:
    return next(s for s in tp.runtime_stages(runtime) if s.stage_index == stage_index)


def _backward_weight(action: Any, ctx: Any) -> None:
    runtime = ctx.schedule_ref
    stage = _stage_of(runtime, action.stage_index)
    runtime.backward_counter[stage.stage_index] += 1
    last = runtime.backward_counter[stage.stage_index] == tp.runtime_microbatches(runtime)
    gathered = stage.stage_index in runtime.unsharded_stages or stage.stage_index in (
        runtime.unshard_ops
    )
    if gathered or not isinstance(stage.submod, FSDPModule):
        tp.wait_gathered(runtime, stage)
        stage.backward_weight_one_chunk(action.microbatch_index, last_backward=last)
        return
    # Ignored below: FSDPModule is a mixin over nn.Module (isinstance narrowed it to the mixin)
    with _unsharded_parameters(stage.submod), tp.fsdp_pre_backward_muted(stage.submod):  # type: ignore[arg-type]
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
        p for m in module.modules() if isinstance(m, FSDPModule) for p in tp.unsharded_params(m)
    ]
    # Parameters FSDP leaves whole (no dimension: `core.shard.fsdp`) are their own objects.
    params += [p for p in module.parameters() if not isinstance(p, DTensor)]
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
        # A weight gradient whose path crosses a unit's output (a parameter read after the
        # stage's last module, e.g. a logit scale) fires FSDP's pre-backward hook, which gathers
        # the unit again: release it as it was, before its stand-in storage goes.
        for unit in module.modules():
            if isinstance(unit, FSDPModule) and tp.is_gathered(unit):
                unit.reshard()
        for p in filled:
            p.untyped_storage().resize_(0)


def _reduce_grad(action: Any, ctx: Any) -> None:
    runtime = ctx.schedule_ref
    stage = _stage_of(runtime, action.stage_index)
    if action.microbatch_index is None:  # torch's end-of-step reduction, as the runtime does it
        scale = tp.runtime_microbatches(runtime) if runtime.scale_grads else 1
        stage.perform_reduce_grad(scale)
        return
    root = stage.submod
    if not isinstance(root, FSDPModule):
        return
    # What perform_reduce_grad does, minus resharding (the block may still be running) and minus
    # scaling (the end-of-step reduction scales everything once).
    root.set_requires_gradient_sync(True)
    root.set_reshard_after_backward(False)
    root.set_is_last_backward(True)
    tp.fill_missing_gradients(root)
    tp.run_post_backward(root)
    root.set_requires_gradient_sync(False)
    root.set_is_last_backward(False)


def _gather(action: Any, ctx: Any) -> None:
    """UNSHARD as torch's runtime does it; once a gather from the post-forward copy has ended,
    that copy's mesh is hidden from FSDP again."""
    runtime = ctx.schedule_ref
    stage = _stage_of(runtime, action.stage_index)
    if not isinstance(stage.submod, FSDPModule):
        return
    assert stage.stage_index not in runtime.unsharded_stages, "gathered twice"
    assert stage.stage_index not in runtime.unshard_ops, "gathered twice"
    for module in stage.submod.modules():  # type: ignore[attr-defined]  # FSDPModule: a mixin
        if isinstance(module, FSDPModule):
            handle = module.unshard(async_op=True)
            runtime.unshard_ops[stage.stage_index].append(_Gathered(handle, module))


class _Gathered:
    """An unshard handle that hides the post-forward copy's mesh once the gather is waited on."""

    def __init__(self, handle: Any, module: FSDPModule) -> None:
        self.handle, self.module = handle, module

    def wait(self) -> None:
        self.handle.wait()
        tp.hide_post_forward_mesh(self.module)


def _release(action: Any, ctx: Any) -> None:
    """RESHARD as torch's runtime does it, to the post-forward copy when the action says so."""
    runtime = ctx.schedule_ref
    stage = _stage_of(runtime, action.stage_index)
    if isinstance(stage.submod, FSDPModule):
        assert stage.stage_index in runtime.unsharded_stages, "released without a gather"
        assert stage.stage_index not in runtime.unshard_ops, "released before the gather ended"
        for module in stage.submod.modules():  # type: ignore[attr-defined]  # FSDPModule: a mixin
            if not isinstance(module, FSDPModule):
                continue
            if action.microbatch_index == _TO_NODE_COPY:
                tp.release_to_post_forward_copy(module)
            else:
                module.reshard()
        runtime.unsharded_stages.remove(stage.stage_index)
