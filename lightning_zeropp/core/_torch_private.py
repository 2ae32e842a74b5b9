"""Every use of a private torch name lives here, so a torch upgrade touches one file.

Covered torch range: 2.13.x (pinned in pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.distributed.pipelining.schedules import (
    FORWARD,
    FULL_BACKWARD,
    RESHARD,
    UNSHARD,
    _Action,
    _add_reduce_grad,
    _add_send_recv,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
)

from lightning_zeropp.core.zeropp_schedule import Task, gather_blocks

__all__ = ["PipelineSchedule", "UnitScheduleRuntime", "on_scheduled_loss"]

PipelineSchedule = _PipelineSchedule


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
    it, then torch's own passes add the end-of-step gradient reduction and the send/recv actions.
    """

    def __init__(
        self,
        stages: list[Any],
        n_microbatches: int,
        loss_fn: Callable[..., Any] | None,
        orders: Mapping[int, Sequence[Task]],
    ) -> None:
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
        kinds = {"F": FORWARD, "B": FULL_BACKWARD}
        self.pipeline_order = {
            rank: [_Action(t.stage, kinds[t.kind], t.microbatch) for t in order]
            for rank, order in orders.items()
        }
        lowered = {
            rank: _add_reduce_grad(_gather_per_block(orders[rank], actions), n_microbatches)
            for rank, actions in self.pipeline_order.items()
        }
        mapping = self.stage_index_to_group_rank
        self.pipeline_order_with_comms = _add_send_recv(
            lowered, stage_to_rank=lambda s: mapping[s], num_stages=self._num_stages
        )


def _gather_per_block(order: Sequence[Task], actions: list[_Action]) -> list[_Action]:
    lowered: list[_Action] = []
    for stage, start, end in gather_blocks(order):
        lowered += [_Action(stage, UNSHARD), *actions[start:end], _Action(stage, RESHARD)]
    return lowered
