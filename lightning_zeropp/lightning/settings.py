"""What a fit must have done: the check that it trained at all.

The strategy's settings take the one path every front takes (`core.settings.merge`): arguments
given in code over the `ZEROPP_*` variables over `ZeroPPConfig`'s defaults.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

__all__ = ["check_trained"]


def check_trained(trainer: pl.Trainer) -> None:
    """A fit that ended normally without one training batch was not meant: say so, on every
    rank (each rank's loader has the same length), instead of exiting 0 with an untrained model.
    `limit_train_batches=0` and `max_steps=0` ask for no training and are left alone."""
    state = trainer.state
    if state.fn != TrainerFn.FITTING or state.status != TrainerStatus.RUNNING:
        return
    if trainer.limit_train_batches == 0 or trainer.max_steps == 0:
        return
    if trainer.num_training_batches == 0:
        raise ValueError(
            "the training dataloader gave no batches on this data-parallel rank, so fit trained "
            "0 steps: the dataset is smaller than one batch per data-parallel rank (with "
            "drop_last=True, or after the sampler split it). Use more data, a smaller "
            "batch_size, or drop_last=False."
        )
