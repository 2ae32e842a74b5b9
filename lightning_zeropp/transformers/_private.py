"""Every private `transformers.Trainer` name the library overrides or reaches lives here.

`ZeroPPTrainer` replaces parts of the Trainer's loop that have no public hook (the model's
wrapping, the token count, gradient clipping, checkpoints); those are private methods, which a
transformers release may rename or re-sign without notice. So they are named once, in this
module, checked on the transformers releases `CHECKED` names (the range `pyproject.toml` pins for
the `hf` extra; CI runs 5.17 and the newest), and verified on the installed release when the
front is imported: a name missing, or a method whose parameters changed, raises an ImportError
naming it, the installed release and the checked range, instead of a loop that silently skips an
override (a renamed method would no longer be called) or fails mid-run.

- `TrainerOverrides`: the private methods overridden, each handing over to the `_zeropp_` method
  of the same name that `ZeroPPTrainer` defines (its class sits right after `ZeroPPTrainer`'s,
  `ZeroPPTrainer` and `TrainerCheckpoints`, in the method order, so a TRL trainer's own methods
  still come after them).
- Functions named for what they do, for each private name only called or read.

`tests/unit/test_private_names.py` fails when a private Trainer name appears anywhere else.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers import Trainer

__all__ = [
    "CHECKED",
    "CHECKED_RANGE",
    "OVERRIDDEN",
    "REACHED",
    "TrainerOverrides",
    "accelerator_args_builder",
    "forget_created_scheduler",
    "load_optimizer_and_scheduler",
    "loss_shifts_labels",
    "num_items_in_batch",
    "run_folder",
    "push_checkpoint",
    "require_checked_trainer",
    "save_checkpoint",
    "save_rng_state",
    "scheduler_created",
    "trainer_init_training_state",
    "trainer_load_rng_state",
    "trainer_num_items_in_batch",
    "trainer_track_num_input_tokens",
]

# [low, high): the transformers releases these names were checked on.
CHECKED = ("5.17", "6")
CHECKED_RANGE = f">={CHECKED[0]},<{CHECKED[1]}"

# Private methods overridden, with the Trainer's parameters (after `self`) on the checked range.
OVERRIDDEN: dict[str, tuple[str, ...]] = {
    "_move_model_to_device": ("model", "device"),
    "_wrap_model": ("model", "training", "dataloader"),
    "_prepare_for_training": ("max_steps", "train_dataloader", "resume_from_checkpoint"),
    "_get_num_items_in_batch": ("batch_samples", "device"),
    "_track_num_input_tokens": ("inputs",),
    "_clip_grad_norm": ("model",),
    "_get_grad_norm": ("model", "grad_norm"),
    "_save_checkpoint": ("model", "trial"),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_init_training_state": (
        "max_steps",
        "num_update_steps_per_epoch",
        "num_train_epochs",
        "resume_from_checkpoint",
        "trial",
    ),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "_load_rng_state": ("checkpoint",),
    "_load_best_model": (),
}
# Private methods only called, with their parameters; None: an attribute the Trainer's own
# code sets on itself (checked in its source: it has no class-level value to look up).
REACHED: dict[str, tuple[str, ...] | None] = {
    "_build_accelerator_args": ("kwargs",),
    "_get_output_dir": ("trial",),
    "_save_rng_state": ("output_dir",),
    "_push_from_checkpoint": ("checkpoint_folder",),
    "_created_lr_scheduler": None,
    "_loss_shifts_labels": None,
}


def _problem(name: str, expected: tuple[str, ...] | None, source: str) -> str | None:
    """What is wrong with the installed Trainer's `name`, or None."""
    if expected is None:
        return None if f"self.{name}" in source else "is not set by the Trainer any more"
    method = getattr(Trainer, name, None)
    if not callable(method):
        return "is missing"
    found = tuple(inspect.signature(method).parameters)[1:]
    if found != expected:
        return f"takes ({', '.join(found)}), checked with ({', '.join(expected)})"
    return None


def require_checked_trainer() -> None:
    """Refuse a `transformers.Trainer` lacking a private name this front overrides or reaches,
    or whose parameters differ from those checked: name it, the release, and the fix."""
    try:
        source = Path(inspect.getsourcefile(Trainer) or "").read_text()
    except OSError:  # no source shipped: the attributes set in code cannot be looked up
        source = "".join(f"self.{name}" for name, params in REACHED.items() if params is None)
    names = {**OVERRIDDEN, **REACHED}
    problems = [
        f"Trainer.{name} {problem}"
        for name, expected in names.items()
        if (problem := _problem(name, expected, source)) is not None
    ]
    if problems:
        raise ImportError(
            f"lightning_zeropp.transformers overrides private methods of transformers.Trainer "
            f"checked on transformers {CHECKED_RANGE}; transformers {transformers.__version__} "
            f"is installed, where {'; '.join(problems)}. Install a checked release, e.g. "
            f'`pip install "transformers{CHECKED_RANGE}"` (the lightning-zeropp[hf] extra).'
        )


class TrainerOverrides(Trainer):
    """The Trainer's private methods `ZeroPPTrainer` replaces, each handing over to its
    `_zeropp_<name>` method (the reasons are written there)."""

    # defined by ZeroPPTrainer
    _zeropp_move_model_to_device: Callable[[nn.Module, torch.device], None]
    _zeropp_wrap_model: Callable[..., Any]
    _zeropp_prepare_for_training: Callable[..., Any]
    _zeropp_get_num_items_in_batch: Callable[[list, torch.device], Any]
    _zeropp_track_num_input_tokens: Callable[[dict[str, Any]], None]
    _zeropp_clip_grad_norm: Callable[[nn.Module], torch.Tensor]
    _zeropp_get_grad_norm: Callable[..., Any]
    _zeropp_save_checkpoint: Callable[[nn.Module, Any], None]
    _zeropp_load_from_checkpoint: Callable[..., None]
    _zeropp_init_training_state: Callable[..., tuple[int, int]]
    _zeropp_load_optimizer_and_scheduler: Callable[[str | None], None]
    _zeropp_load_rng_state: Callable[[str | None], None]
    _zeropp_load_best_model: Callable[[], None]

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        self._zeropp_move_model_to_device(model, device)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> Any:
        return self._zeropp_wrap_model(model, training, dataloader)

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
    ) -> Any:
        return self._zeropp_prepare_for_training(
            max_steps, train_dataloader, resume_from_checkpoint
        )

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        return self._zeropp_get_num_items_in_batch(batch_samples, device)

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        self._zeropp_track_num_input_tokens(inputs)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self._zeropp_clip_grad_norm(model)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return self._zeropp_get_grad_norm(model, grad_norm)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        self._zeropp_save_checkpoint(model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        self._zeropp_load_from_checkpoint(resume_from_checkpoint, model)

    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: str | None,
        trial: Any,
    ) -> tuple[int, int]:
        return self._zeropp_init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        self._zeropp_load_optimizer_and_scheduler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        self._zeropp_load_rng_state(checkpoint)

    def _load_best_model(self) -> None:
        self._zeropp_load_best_model()


# ---------------------------------------------------------------- the Trainer's own, called
def trainer_num_items_in_batch(
    trainer: TrainerOverrides, batch_samples: list, device: torch.device
) -> Any:
    """The next class's (the Trainer's, or a TRL trainer's) token count of a window."""
    return super(TrainerOverrides, trainer)._get_num_items_in_batch(batch_samples, device)


def trainer_track_num_input_tokens(trainer: TrainerOverrides, inputs: dict[str, Any]) -> None:
    super(TrainerOverrides, trainer)._track_num_input_tokens(inputs)


def trainer_init_training_state(trainer: TrainerOverrides, *args: Any) -> tuple[int, int]:
    return super(TrainerOverrides, trainer)._init_training_state(*args)


def trainer_load_rng_state(trainer: Trainer, checkpoint: str) -> None:
    """`Trainer._load_rng_state` itself (not the override): it restores the RNG file."""
    Trainer._load_rng_state(trainer, checkpoint)


def save_checkpoint(trainer: Trainer, model: Any) -> None:
    """The Trainer's checkpoint of this step, through the override (`_save_checkpoint`)."""
    trainer._save_checkpoint(model, trial=None)


def load_optimizer_and_scheduler(trainer: Trainer, checkpoint: str | None) -> None:
    trainer._load_optimizer_and_scheduler(checkpoint)


def num_items_in_batch(trainer: Trainer, batch_samples: list, device: torch.device) -> Any:
    """The token count through the override (`_get_num_items_in_batch`), a collective."""
    return trainer._get_num_items_in_batch(batch_samples, device)


def run_folder(trainer: Trainer, trial: Any) -> str:
    """The run's folder, where `checkpoint-<step>` goes."""
    return trainer._get_output_dir(trial=trial)


def save_rng_state(trainer: Trainer, folder: str) -> None:
    trainer._save_rng_state(folder)


def push_checkpoint(trainer: Trainer, folder: str) -> None:
    trainer._push_from_checkpoint(folder)


def accelerator_args_builder(trainer: Trainer) -> Callable[..., dict[str, Any]]:
    """The Trainer's builder of its `Accelerator`'s arguments."""
    return trainer._build_accelerator_args


def scheduler_created(trainer: Trainer) -> bool:
    """Whether the Trainer created its scheduler itself (not one passed in)."""
    return bool(trainer._created_lr_scheduler)


def forget_created_scheduler(trainer: Trainer) -> None:
    """Drop the Trainer's own scheduler, so `create_scheduler` builds it again."""
    trainer.lr_scheduler = None
    trainer._created_lr_scheduler = False


def loss_shifts_labels(trainer: Trainer) -> bool:
    """Whether the Trainer's `compute_loss_func` expects labels shifted by one."""
    return bool(getattr(trainer, "_loss_shifts_labels", False))


require_checked_trainer()
