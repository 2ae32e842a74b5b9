"""The strategy's settings and what a fit must have done: `ZeroPPStrategy`'s arguments over the
`ZEROPP_*` variables, resolved for the world, and the check that a fit trained at all.

Arguments and variables combine as in the Accelerate front's `ZeroPPPlugin`: an argument left
out (None) takes its variable, one given in code wins, a typo in a variable's name is an error,
and a bad value that came from a variable is reported with the variable.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from lightning_zeropp.core.settings import env
from lightning_zeropp.core.settings.config import ZeroPPConfig

__all__ = ["check_trained", "config_from_arguments", "resolve_config"]


def config_from_arguments(**settings: Any) -> tuple[ZeroPPConfig, str]:
    """The config from the strategy's arguments over the `ZEROPP_*` variables (`core.settings.env`), and
    the variables it took (described, "" for none)."""
    given = {k: v for k, v in settings.items() if v is not None}
    used = {var: field for var, field in env.CONFIG_VARS.items() if field not in given}
    found = [
        f"{var}={os.environ[var]} ({field})" for var, field in used.items() if var in os.environ
    ]
    return dataclasses.replace(env.config_from_env(), **given), ", ".join(found)


def resolve_config(config: ZeroPPConfig, world_size: int, from_env: str) -> ZeroPPConfig:
    """`config.resolve(world_size)`; a bad value names the variables that set it, if any (the
    user never wrote it)."""
    try:
        return config.resolve(world_size)
    except ValueError as err:
        if not from_env:
            raise
        raise ValueError(f"{err} (settings from the environment: {from_env})") from err


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
