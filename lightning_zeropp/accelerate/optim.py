"""The user's LR scheduler stepped as Accelerate steps it, over the rebuilt optimizer.

The rebuild itself (optimizer and scheduler moved onto the stages) is framework-free and lives in
the fronts' shared room (`lightning_zeropp.fronts.optim`); what is Accelerate's here is when and
how often the scheduler steps.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["PipelineScheduler"]


class PipelineScheduler:
    """Steps the user's scheduler after each optimizer step, as Accelerate's own wrapper does.

    Accelerate's convention: with `split_batches=False` each process loads a whole batch, the
    data loader is `n` times shorter, so a scheduler written for one process steps `n` times per
    optimizer step. Under a pipeline only the data-parallel ranks divide the data, so `n` is the
    data-parallel size here, not the process count (`AcceleratedScheduler` would use the latter).
    With `split_batches=True` it steps once. During gradient accumulation (inside
    `accelerator.accumulate()`, between optimizer steps) it does not step.
    """

    def __init__(
        self, scheduler: Any, accelerator: Any, optimizer: Any, steps_per_call: int
    ) -> None:
        self.scheduler = scheduler
        self._accelerator = accelerator
        self._optimizer = optimizer
        self.steps_per_call = steps_per_call

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._accelerator.step_scheduler_with_optimizer:
            if not self._accelerator.sync_gradients:
                return  # accumulating: the optimizer did not step either
            if getattr(self._optimizer, "step_was_skipped", False):
                return
        # ReduceLROnPlateau steps on a metric: once per call, whatever the data split.
        calls = 1 if args or kwargs else self.steps_per_call
        total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR raises past its end
        with warnings.catch_warnings():
            # torch wraps an optimizer's `step` when a scheduler is built on it, to warn about
            # misordered calls; the rebuilt optimizer never had a scheduler built on it, so torch
            # would warn that its step "has been overridden". It has not: silence that one.
            warnings.filterwarnings("ignore", message=r"Seems like `optimizer.step\(\)` has been")
            for _ in range(calls):
                if total is not None and self.scheduler.last_epoch >= total:
                    break
                self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:  # last_epoch, base_lrs, ... of the real scheduler
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
