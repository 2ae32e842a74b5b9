"""torch's pipelining internals: the schedule runtime's private names and state, the stage's
shape inference, and its split backward (`core.schedule.runtime`, `core.engine`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeGuard

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import stage as _stage_module
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_reduce_grad,
    _add_send_recv,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
)
from torch.distributed.pipelining.stage import _RecvInfo

from lightning_zeropp.core._torch_private.version import at_least

# torch 2.13 gave the schedules' loss call keyword arguments (`step(..., loss_kwargs=)`, passed
# on as `_compute_loss(output, target, loss_kwargs)`); 2.11 and 2.12 call
# `_compute_loss(output, target)`.
LOSS_KWARGS = at_least(2, 13)

# torch 2.12 passes tensors that take no gradient (an HF model's attention mask or position ids)
# between stages: received without requires_grad, and no gradient sent back for them (it records
# each one's requires_grad). 2.11 makes every received tensor require grad (which fails on
# integers) and mirrors every one in backward; `ShapeInferenceStage` does what 2.12 does there
# (`_FloatGradientsOnly`).
NON_FLOAT_BETWEEN_STAGES = at_least(2, 12)

# torch 2.11's runtime warms up the point-to-point links on the first step by sending to each
# neighbour stage's rank, itself included when that stage is on the same rank (the V placement
# of ZBV, DualPipeV, ZeroPP), which gloo refuses ("Pair is not connected"); 2.12 replaced that
# warm-up. Those self-sends carry nothing, so they are dropped.
WARMUP_SENDS_TO_ITSELF = not at_least(2, 12)

__all__ = [
    "Action",
    "PipelineSchedule",
    "ScheduleRuntime",
    "ShapeInferenceStage",
    "add_reduce_grad",
    "add_send_recv",
    "on_scheduled_loss",
    "runtime_has_backward",
    "runtime_microbatches",
    "runtime_num_stages",
    "runtime_stages",
    "set_runtime_has_backward",
    "stage_backward_input",
    "stage_backward_weight",
    "wait_gathered",
]


PipelineSchedule = _PipelineSchedule


def _floating(buffer: torch.Tensor | None) -> TypeGuard[torch.Tensor]:
    assert buffer is not None  # torch allocates a receive buffer before these methods read it
    return buffer.is_floating_point()


class _FloatGradientsOnly(PipelineStage):
    """torch 2.12's handling of stage inputs that take no gradient, on 2.11: their
    receive buffers do not require grad, no gradient is sent or received for them, and the split
    backward's input gradients stay aligned with the stage's inputs (None for those); and, as
    2.12, no check of the last stage's outputs against shape inference."""

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        backward = self.has_backward
        self.has_backward = False  # else every receive buffer is made to require grad
        try:
            out = super()._prepare_forward_infra(*args, **kwargs)
        finally:
            self.has_backward = backward
        if backward:
            for infos in self.args_recv_info.values():
                for info in infos:
                    if isinstance(info, _RecvInfo) and _floating(info.buffer):
                        info.buffer.requires_grad_(True)
        return out

    def set_local_fwd_input(self, prev_stage_outputs: Any, mb_index: int) -> None:
        outputs = _stage_module._normalize_model_output_as_tuple(prev_stage_outputs)
        for info, tensor in zip(self.args_recv_info[mb_index], outputs, strict=False):
            info.buffer = tensor.detach().requires_grad_(tensor.is_floating_point())

    def set_local_bwd_input(self, next_stage_bwd_outputs: tuple, mb_index: int) -> None:
        for info, grad in zip(self.grad_recv_info[mb_index], next_stage_bwd_outputs, strict=False):
            info.buffer = grad  # None for an output that took no gradient

    def _create_grad_send_info(self, args_recv_info: tuple) -> list[int | None]:
        sends = super()._create_grad_send_info(args_recv_info)
        return [
            None if isinstance(info, _RecvInfo) and not _floating(info.buffer) else send
            for info, send in zip(args_recv_info, sends, strict=False)
        ]

    def _create_grad_recv_info(self, act_send_info: dict) -> tuple[Any, ...]:
        infos = super()._create_grad_recv_info(act_send_info)
        # Only used before torch 2.12 (_StageBase below), whose PipelineStage has this method.
        metas = self.get_outputs_meta()  # type: ignore[attr-defined]
        for index, info in zip(act_send_info, infos, strict=False):  # none on the last stage
            if not metas[index].is_floating_point():
                info.buffer = None  # no gradient comes back for it
        return infos

    def _validate_fwd_outputs(self, outputs: tuple[torch.Tensor, ...]) -> None:
        # torch 2.12 validates no stage's outputs; 2.11 checks them against shape inference.
        # The last stage's go nowhere, and there a chunked head (`fronts.hf_chunked`) returns its
        # hidden states in training where inference (unarmed) saw logits.
        if not self.is_last:
            # Only used before torch 2.12 (_StageBase below), whose PipelineStage has it.
            super()._validate_fwd_outputs(outputs)  # type: ignore[misc]

    def _get_recv_ops(self, recv_infos: tuple[Any, ...]) -> list[Any]:
        kept = tuple(i for i in recv_infos if not (isinstance(i, _RecvInfo) and i.buffer is None))
        return super()._get_recv_ops(kept)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[tuple[Any, ...], Any]:
        if backward_type != "input":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        outputs, grads = bwd_kwargs["stage_output"], bwd_kwargs["output_grads"]
        if grads is not None:  # outputs that take no gradient have none coming back
            pairs = zip(outputs, grads, strict=False)
            kept = [(o, g) for o, g in pairs if getattr(o, "requires_grad", False)]
            outputs, grads = tuple(o for o, _ in kept), [g for _, g in kept]
        inputs = bwd_kwargs["input_values"]
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]  # not a float, say
        call = {**bwd_kwargs, "stage_output": outputs, "output_grads": grads}
        call["input_values"] = tensors
        dinputs, groups = super().backward_maybe_with_nosync(backward_type, call, last_backward)
        # torch returns gradients of the inputs that require grad only: realign with the inputs
        given = iter(dinputs)
        aligned = (next(given) if getattr(x, "requires_grad", False) else None for x in inputs)
        return tuple(aligned), groups


_StageBase: type = PipelineStage if NON_FLOAT_BETWEEN_STAGES else _FloatGradientsOnly


class ShapeInferenceStage(_StageBase):
    """torch's `PipelineStage` calling `after_forward_inference()` once its first-step forward
    shape inference (`_prepare_forward_infra`) has run (`core.schedule.runtime.LeanStage`)."""

    # Set by the engine: times shape inference (`core.measure.planning.PlanningStats.timed`).
    inference_clock: Any = None
    # Set by the engine: a context manager factory its shape inference runs in (context
    # parallelism pauses its attention: the inputs a later stage infers from are not real).
    inference_context: Any = None

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with self._timed():
            try:
                return super()._prepare_forward_infra(*args, **kwargs)
            finally:
                self.after_forward_inference()

    def _get_init_p2p_neighbors_ops(self) -> list[Any]:
        ops = super()._get_init_p2p_neighbors_ops()
        if WARMUP_SENDS_TO_ITSELF:
            ops = [op for op in ops if op.group_peer != self.group_rank]
        return ops

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with self._timed():
            return super()._prepare_backward_infra(*args, **kwargs)

    def _timed(self) -> Any:
        clock, context = self.inference_clock, self.inference_context
        stack = contextlib.ExitStack()
        stack.enter_context(clock.timed() if clock is not None else contextlib.nullcontext())
        stack.enter_context(context() if context is not None else contextlib.nullcontext())
        return stack

    def after_forward_inference(self) -> None:
        """Called after forward shape inference (default: nothing)."""


def on_scheduled_loss(schedule: _PipelineSchedule, wrapper: Callable[..., Any]) -> None:
    """Route the schedule's real per-micro-batch loss calls through `wrapper(compute, *args)`.

    The runtime also calls the loss function once, outside `_compute_loss`, to infer gradient
    shapes on the first step (and after each train/eval switch). Hooking `_compute_loss` tells the
    two apart, so side effects such as logging happen once per real micro-batch only.
    """
    compute = schedule._compute_loss
    if not LOSS_KWARGS:
        two_arguments = compute

        def compute(output: Any, target: Any, loss_kwargs: dict[str, Any] | None = None) -> Any:
            return two_arguments(output, target)  # no loss_kwargs before 2.13: always None

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
