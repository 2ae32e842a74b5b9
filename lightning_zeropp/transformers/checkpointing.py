"""`ZeroPPTrainer`'s checkpoints: the Trainer's folders, with the model and optimizer sharded.

A `checkpoint-<step>` folder holds what the Trainer's holds (`trainer_state.json`, the
scheduler, one RNG state per process, the callbacks' state) but the model and optimizer as a
distributed checkpoint in `zeropp/` (each rank writes its shards; loadable under any layout),
never gathered into one process. The folder is written under a hidden temporary name and renamed
into place once every rank has finished (`core.weights.commit`): `get_last_checkpoint` and
`resume_from_checkpoint=True` never meet a half-written one, and the Trainer's rotation
(`save_total_limit`) deletes them as its own.

Resuming reads the folder as data: its files' checksums (`SHA256SUMS`, written at save) first,
then every pickle with `weights_only=True` (`core.weights.trust`): `meta.pt`, `scheduler.pt` and
this process's `rng_state_<i>.pth` (the Trainer's own RNG load runs under torch's switch that
forces `weights_only`); a file that would run code, or that does not fit, is named with the fix. `save_model` is different: the whole model, as an
ordinary HF directory, written by the main process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_pt_utils import safe_globals
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

from lightning_zeropp.accelerate.checkpointing import CHECKPOINT_DIR
from lightning_zeropp.core.step import resumed_rows
from lightning_zeropp.core.weights import checkpoint as ckpt
from lightning_zeropp.core.weights import checksum, commit, trust
from lightning_zeropp.transformers._private import (
    push_checkpoint,
    run_folder,
    save_rng_state,
    trainer_load_rng_state,
)

__all__ = [
    "BATCH_FILE",
    "check_resumable",
    "check_resumed_rows",
    "load",
    "load_best_model",
    "load_rng_state",
    "save",
    "save_model",
]

_MODEL_ONLY = "model_only"  # in the sharded checkpoint's metadata: saved with save_only_model
BATCH_FILE = "zeropp_batch.json"  # the global batch the checkpoint was trained with
_ROWS_PER_STEP = "rows_per_step"


def save(trainer: Any, trial: Any) -> None:
    """Collective: `Trainer._save_checkpoint`, sharded and committed atomically."""
    args, state = trainer.args, trainer.state
    if trainer.hp_search_backend is None and trial is None:
        trainer.store_flos()
    run_dir = Path(run_folder(trainer, trial))
    final = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    tmp = Path(ckpt.broadcast_str(str(commit.temporary(final))))
    engine = trainer.pipeline.engine
    if args.save_only_model:
        meta = {_MODEL_ONLY: True, "world_size": dist.get_world_size()}
        ckpt.save_checkpoint(tmp / CHECKPOINT_DIR, engine.module, [], meta)
    else:
        engine.save(tmp)
        if args.should_save:
            torch.save(trainer.lr_scheduler.state_dict(), tmp / SCHEDULER_NAME)
        save_rng_state(trainer, str(tmp))  # every process its own
    _record_best(trainer, run_dir, final)
    if args.should_save:
        _save_trainer_state(trainer, tmp)
        rows = {_ROWS_PER_STEP: trainer.get_total_train_batch_size(args)}
        (tmp / BATCH_FILE).write_text(json.dumps(rows))
    dist.barrier()
    if dist.get_rank() == 0:
        checksum.write_folder_sums(tmp)  # the Trainer's files, checked before a resume reads them
        run_dir.mkdir(parents=True, exist_ok=True)
        commit.publish(tmp, final, link=False)  # a real folder: the Trainer lists and deletes it
    dist.barrier()
    if args.push_to_hub:
        push_checkpoint(trainer, str(final))
    if args.should_save:
        rotate_checkpoints(
            output_dir=str(run_dir),
            save_total_limit=args.save_total_limit,
            best_model_checkpoint=state.best_model_checkpoint,
            use_mtime=True,
        )


def _record_best(trainer: Any, run_dir: Path, final: Path) -> None:
    """The Trainer's bookkeeping of the best checkpoint (the folder being written counts)."""
    args, state = trainer.args, trainer.state
    strategies = (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
    if args.save_strategy not in strategies or not state.best_global_step:
        return
    best = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}"
    if best == final or best.exists():
        state.best_model_checkpoint = str(best)


def _save_trainer_state(trainer: Any, folder: Path) -> None:
    state = trainer.state
    for cb in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(cb, ExportableState):
            name = cb.__class__.__name__
            if isinstance(state.stateful_callbacks[name], list):
                state.stateful_callbacks[name].append(cb.state())
            else:
                state.stateful_callbacks[name] = cb.state()
    state.save_to_json(str(folder / TRAINER_STATE_NAME))


def check_resumable(folder: str | os.PathLike[str]) -> None:
    """Raise on every rank (they share the filesystem) unless `folder` is a ZeroPPTrainer
    checkpoint that holds optimizer state."""
    sharded = Path(folder) / CHECKPOINT_DIR
    if not ckpt.is_checkpoint(sharded):
        hint = ""
        if any((Path(folder) / n).is_file() for n in ("model.safetensors", "pytorch_model.bin")):
            hint = (
                " It holds a whole model (a plain Trainer's checkpoint): start from its weights "
                f"with ZeroPPPlugin(load_from={str(folder)!r}) instead of resuming."
            )
        raise ValueError(
            f"resume_from_checkpoint={str(folder)!r} is not a ZeroPPTrainer checkpoint (no "
            f"sharded state in {sharded}).{hint}"
        )
    problem = checksum.verify(Path(folder), 0, 1) or checksum.verify(sharded, 0, 1, shards=False)
    if problem is not None:
        raise ValueError(problem)
    meta = trust.load_meta(sharded / ckpt.META_FILE)
    if meta.get(_MODEL_ONLY):
        raise ValueError(
            f"{folder} was saved with save_only_model=True: it holds no optimizer or scheduler "
            "state to resume from. Start from its weights with ZeroPPPlugin(load_from="
            f"{str(sharded)!r}), or save without save_only_model."
        )


def check_resumed_rows(trainer: Any, folder: str | os.PathLike[str]) -> None:
    """Refuse, on every rank, a resume whose global batch (rows per optimizer step) differs
    from the checkpoint's: the Trainer skips `global_step` steps of this run's batch, which are
    other rows than the trained ones. With `ignore_data_skip` nothing is skipped: not checked."""
    record = Path(folder) / BATCH_FILE
    if trainer.args.ignore_data_skip or not record.is_file():  # not: saved before the record
        return
    saved = json.loads(record.read_text()).get(_ROWS_PER_STEP)
    steps = trainer.state.global_step
    resumed_rows.check_resumed_rows(
        steps,
        saved,
        trainer.get_total_train_batch_size(trainer.args),
        f"this run resumes from {folder} after {steps} optimizer steps",
        unit="steps",
        fix=(
            "Resume with the checkpoint's global batch (per_device_train_batch_size x "
            "gradient_accumulation_steps x processes), or pass ignore_data_skip=True to "
            "start the data over knowingly."
        ),
    )


def load(trainer: Any, folder: str | os.PathLike[str]) -> None:
    """Collective: the sharded model and optimizer, and the scheduler, of a checkpoint."""
    check_resumable(folder)
    trainer.pipeline.engine.load(folder)
    scheduler = Path(folder) / SCHEDULER_NAME
    state = trust.read_data(scheduler)
    try:
        trainer.lr_scheduler.load_state_dict(state)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(
            f"{scheduler} does not fit the scheduler {type(trainer.lr_scheduler).__name__} "
            f"({type(err).__name__}: {err}): it was saved by another scheduler, or edited. "
            "Resume with the scheduler (lr_scheduler_type) the checkpoint was saved with, or "
            "from another checkpoint."
        ) from None


def load_rng_state(trainer: Any, folder: str | os.PathLike[str]) -> None:
    """Collective: `Trainer._load_rng_state`, reading this process's `rng_state_<i>.pth` as
    data; a file that names code or holds no RNG state is named on every rank, with the fix."""
    name = f"rng_state_{trainer.args.process_index}.pth"
    file = Path(folder) / (name if trainer.args.world_size > 1 else "rng_state.pth")
    fix = (
        "Delete it to resume without restoring the random state (dropout and shuffling then "
        "differ from an uninterrupted run), or resume from another checkpoint."
    )
    problem = None
    try:
        if file.is_file():
            with safe_globals():  # the Trainer's own allowlist: numpy's RNG state types
                state = trust.read_data(file, allowed=torch.serialization.get_safe_globals())
            if not isinstance(state, dict) or not {"python", "numpy", "cpu"} <= set(state):
                raise ValueError(
                    f"{file} holds no RNG state the Trainer wrote (keys python, numpy, cpu): "
                    f"it was edited or replaced. {fix}"
                )
        with trust.weights_only_loads():  # the Trainer reads it again: as data, whatever it asks
            trainer_load_rng_state(trainer, str(folder))
    except ValueError as err:
        problem = str(err) if str(file) in str(err) else f"{file}: {err}. {fix}"
    except (KeyError, TypeError, RuntimeError) as err:
        problem = f"{file} does not restore the random state ({type(err).__name__}: {err}). {fix}"
    ckpt.raise_on_every_rank(problem)


def load_best_model(trainer: Any) -> None:
    """Collective: the model weights of `state.best_model_checkpoint` (load_best_model_at_end)."""
    sharded = Path(trainer.state.best_model_checkpoint) / CHECKPOINT_DIR
    engine = trainer.pipeline.engine
    with engine.core.failures.guard():
        ckpt.load_checkpoint(sharded, engine.module, [])


def save_model(trainer: Any, output_dir: str) -> None:
    """Collective: the whole model as `save_pretrained` writes it, from the main process."""
    pipeline = trainer.pipeline
    if pipeline is None:  # never split: the model still holds its own weights
        Trainer.save_model(trainer, output_dir)
        return
    state = trainer.accelerator.get_state_dict(pipeline)  # {} but on the main process
    if trainer.args.should_save:
        os.makedirs(output_dir, exist_ok=True)
        # The model passed in holds no weights any more (meta): the state dict is the model.
        trainer.model.save_pretrained(output_dir, state_dict=state, safe_serialization=True)
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(output_dir)
        torch.save(trainer.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
    trainer.accelerator.wait_for_everyone()
