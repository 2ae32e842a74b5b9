"""torch's pipelining internals: the schedule runtime's private names and state, the stage's
shape inference, and its split backward (`core.schedule.runtime`, `core.engine`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

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
