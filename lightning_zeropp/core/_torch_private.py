"""Every use of a private torch name lives here, so a torch upgrade touches one file.

Covered torch range: 2.13.x (pinned in pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.pipelining.schedules import _PipelineSchedule

__all__ = ["PipelineSchedule", "on_scheduled_loss"]

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
