"""The step's loss: the function the schedule calls on the last stage, and the step's mean loss
sent to every rank.

torch's schedule runtime calls the loss function for each real micro-batch, and once more on the
first step (and after each train/eval switch) to infer gradient shapes; `StepLoss` gives that
probe call its own function, so side effects such as logging happen once per micro-batch only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LossFn", "StepLoss", "broadcast_loss"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


class StepLoss:
    """`loss_fn` for the schedule's micro-batches, `probe_loss_fn` for its shape-inference call,
    each called on the model's output as the model returns it (`restore(output)`).

    Install with `on_scheduled_loss(schedule, step_loss.scheduled)`; build the schedule with the
    `StepLoss` itself as its loss function.
    """

    def __init__(self, loss_fn: LossFn, probe_loss_fn: LossFn, restore: Callable[[Any], Any]):
        self._loss_fn = loss_fn
        self._probe_loss_fn = probe_loss_fn
        self._restore = restore
        self._in_scheduled_loss = False

    def __call__(self, output: Any, target: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        fn = self._loss_fn if self._in_scheduled_loss else self._probe_loss_fn
        loss = fn(self._restore(output), target, **kwargs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            # On the last stage, inside the failure board's guard: every rank is told.
            what = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn returned {what}; it must return one scalar tensor, the mean loss of "
                "the micro-batch (e.g. cross_entropy with reduction='mean')."
            )
        return loss

    def scheduled(
        self, compute: Callable[..., Any], output: Any, target: Any, loss_kwargs: Any
    ) -> torch.Tensor:
        """The schedule's own loss call for one real micro-batch (`on_scheduled_loss`)."""
        self._in_scheduled_loss = True
        try:
            return compute(output, target, loss_kwargs)
        finally:
            self._in_scheduled_loss = False


def broadcast_loss(
    losses: list[torch.Tensor],
    device: torch.device,
    pp_group: Any,
    pp_size: int,
    last_pp_rank: int,
    dp_groups: Sequence[Any],
    dp_size: int,
) -> torch.Tensor:
    """The step's loss on every rank: the mean of the last stage's micro-batch losses, sent
    along the pipeline, then the mean over the data-parallel groups."""
    if losses:
        loss = torch.stack([x.detach().float() for x in losses]).mean().to(device)
    else:
        loss = torch.zeros((), dtype=torch.float32, device=device)
    if pp_size > 1:
        dist.broadcast(loss, group=pp_group, group_src=last_pp_rank)
    # Every dp group has its own batch: the step's loss is the mean over all of them.
    for group in dp_groups:
        dist.all_reduce(loss, group=group)
    return loss / dp_size
