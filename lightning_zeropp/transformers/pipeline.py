"""How `ZeroPPTrainer` builds its pipeline. The Trainer prepares its training loader before the
model, and `ZeroPPAccelerator.prepare` must see the model, its optimizer and that loader together:
so loaders are built by the Trainer's own code unprepared, and the first one needed builds the
pipeline (the optimizer created on the whole model, as under DDP, then rebuilt over this rank's
stages; a scheduler passed in retargeted to it), and the model passed in is released
(`release`); training then creates its scheduler on that
optimizer and resumes a checkpoint into both."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from lightning_zeropp.accelerate.steps import PipelineModel
from lightning_zeropp.fronts.optim import retarget_scheduler
from lightning_zeropp.transformers._private import (
    forget_created_scheduler,
    load_optimizer_and_scheduler,
    run_folder,
    save_checkpoint,
    scheduler_created,
)

__all__ = ["build", "prepare_for_training", "save_on_sigterm", "unprepared_loaders"]


@contextlib.contextmanager
def unprepared_loaders(accelerator: Any) -> Iterator[None]:
    """The Trainer's loader, built by its own code but not prepared: the pipeline shards
    loaders over its data-parallel ranks, and needs the training loader to be built."""
    accelerator.prepare = lambda loader: loader  # shadows the method on this instance
    try:
        yield
    finally:
        del accelerator.prepare


def build(trainer: Any, loader: DataLoader) -> tuple[PipelineModel, DataLoader]:
    """Split, shard and schedule the trainer's model; rebuild the optimizer (and a scheduler
    passed in) over this rank's stages; the pipeline, and `loader` sharded over data-parallel
    ranks."""
    if trainer.optimizer is None:
        trainer.create_optimizer()  # on the whole model, as under DDP
    given = trainer.lr_scheduler if not scheduler_created(trainer) else None
    whole = trainer.optimizer
    pipeline, optimizer, prepared = trainer.accelerator.prepare(trainer.model, whole, loader)
    trainer.optimizer = optimizer
    if given is not None:  # the Trainer steps it once per update, as it is
        trainer.lr_scheduler = retarget_scheduler(given, whole, optimizer.optimizer)
    return pipeline, prepared


def prepare_for_training(
    trainer: Any,
    pipeline: PipelineModel,
    max_steps: int,
    train_dataloader: DataLoader,
    resume: str | None,
) -> None:
    """The pipeline and the rebuilt optimizer exist (the training loader built them): the
    scheduler is created on that optimizer, and a checkpoint resumed into both."""
    if scheduler_created(trainer):
        forget_created_scheduler(trainer)
    trainer.create_scheduler(num_training_steps=max_steps)
    trainer.model_wrapped = pipeline
    load_optimizer_and_scheduler(trainer, resume)
    for attr in ("model", "optimizer", "lr_scheduler"):
        setattr(trainer.callback_handler, attr, getattr(trainer, attr))
    trainer.callback_handler.train_dataloader = train_dataloader


def save_on_sigterm(trainer: Any, steps: int) -> str:
    """Collective: `checkpoint-<global_step>`, which `resume_from_checkpoint=True` finds."""
    save_checkpoint(trainer, trainer.model_wrapped)
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    path = os.path.join(run_folder(trainer, trial=None), name)
    return f"saved checkpoint at {path} (resume with train(resume_from_checkpoint=True))"
