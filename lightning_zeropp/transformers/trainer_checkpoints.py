"""`TrainerCheckpoints`: `ZeroPPTrainer`'s checkpoint methods, the Trainer's own hooks for
saving, resuming and the final model, each handing over to the front's `checkpointing`: sharded
checkpoints committed atomically, a resume checked on every rank (its folder, its global batch)
before anything is skipped, the RNG file read as data, and `save_model` an ordinary HF directory.

`ZeroPPTrainer` derives from it, and it from `TrainerOverrides` (which hands each private
Trainer method overridden to the `_zeropp_` method of its name), so the method order is
`ZeroPPTrainer`, `TrainerCheckpoints`, `TrainerOverrides`, then a TRL trainer's and the Trainer's.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_zeropp.transformers import checkpointing
from lightning_zeropp.transformers._private import TrainerOverrides, trainer_init_training_state

__all__ = ["TrainerCheckpoints"]


class TrainerCheckpoints(TrainerOverrides):
    """`ZeroPPTrainer`'s checkpoint methods: saves, resumes and the final model."""

    def _zeropp_save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        checkpointing.save(self, trial)

    def _zeropp_load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Checked here, on every rank; loaded once the pipeline exists (`_prepare_for_training`)."""
        checkpointing.check_resumable(resume_from_checkpoint)

    def _zeropp_init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: str | None,
        trial: Any,
    ) -> tuple[int, int]:
        """The Trainer's; a resume with another global batch than the checkpoint's is refused
        here, before anything is skipped (`checkpointing.check_resumed_rows`)."""
        sizes = (max_steps, num_update_steps_per_epoch, num_train_epochs)
        done = trainer_init_training_state(self, *sizes, resume_from_checkpoint, trial)
        if resume_from_checkpoint is not None:
            checkpointing.check_resumed_rows(self, resume_from_checkpoint)
        return done

    def _zeropp_load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        """Collective: the sharded model and optimizer, and the scheduler, of a checkpoint."""
        if checkpoint_dir is not None:
            checkpointing.load(self, checkpoint_dir)

    def _zeropp_load_rng_state(self, checkpoint: str | None) -> None:
        """The Trainer's, reading the RNG file as data (named, with the fix, if it is not)."""
        if checkpoint is not None:
            checkpointing.load_rng_state(self, checkpoint)

    def _zeropp_load_best_model(self) -> None:
        checkpointing.load_best_model(self)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective: an ordinary HF directory (`from_pretrained` reads it) from the main
        process; a PEFT model's adapters only, as the Trainer writes them."""
        output_dir = output_dir or self.args.output_dir
        assert output_dir is not None  # TrainingArguments fills in a default
        checkpointing.save_model(self, output_dir)
