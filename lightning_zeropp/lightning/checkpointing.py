"""Lightning checkpoints under `ZeroPPStrategy`: sharded directories or one full file.

`state_dict_type="sharded"` (default): `trainer.save_checkpoint(path)` writes a distributed
checkpoint directory (`core.weights.checkpoint`): the model under the LightningModule's own names (e.g.
`model.blocks.0.attn.qkv.weight`) as `model`, each optimizer flattened as `optimizer_<i>`, and
Lightning's other keys in `meta.pt`. That is the layout Lightning's FSDP checkpoints have, so
Lightning's own `python -m lightning.pytorch.utilities.consolidate_checkpoint PATH` turns it into
one file that `MyModule.load_from_checkpoint` reads.

`state_dict_type="full"`: one ordinary Lightning checkpoint file, written by global rank 0
(`core.weights.export` gathers the model and each optimizer): `state_dict` keyed exactly as the
LightningModule's `state_dict()` in one process, `optimizer_states` as one-process
`optimizer.state_dict()`s (plus each group's `param_names`), and the usual Lightning keys.

Either kind resumes under any layout (`ckpt_path=`): a directory through DCP, a file by every rank
reading it and keeping its own shards. `ckpt_path="last"` finds the newest complete checkpoint
whatever point of a save a kill interrupted (`recover_last`, `core.weights.commit.recover`).
Both kinds are read as data (`core.weights.trust`): a file with
`torch.load(weights_only=True)` whatever `weights_only` Lightning passes, the classes of the
running module's own hyperparameters allowed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch import nn

from lightning_zeropp.core.weights import checkpoint as ckpt
from lightning_zeropp.core.weights import commit, export, trust
from lightning_zeropp.core.weights.async_checkpoint import AsyncCheckpointer
from lightning_zeropp.lightning import data, stopped_epoch

__all__ = [
    "STATE_DICT_TYPES",
    "StrategyCheckpoints",
    "check_state_dict_type",
    "load_full_file",
    "recover_last",
]

STATE_DICT_TYPES = ("sharded", "full")


def check_state_dict_type(value: str) -> str:
    if value not in STATE_DICT_TYPES:
        raise ValueError(
            f"state_dict_type={value!r} is not one of {STATE_DICT_TYPES}: use 'sharded' (a "
            "distributed checkpoint directory per save, the default) or 'full' (one ordinary "
            "Lightning checkpoint file, written by global rank 0)."
        )
    return value


def load_full_file(
    path: Path,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    trusted: set[type] | None = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Collective: every rank reads the checkpoint file at `path` (as data: `trusted` classes
    may appear in it) and keeps its own shards of the model (and of each optimizer's state, if
    `optimizers` and the file has them). Returns the checkpoint, for Lightning to restore the
    rest (loops, schedulers, callbacks)."""
    # mmap: ranks on one machine share the file's pages instead of each holding a copy.
    try:
        checkpoint = trust.read_data(path, trusted or (), mmap=True)
        problem = None
    except ValueError as err:
        problem = str(err)
    ckpt.raise_on_every_rank(problem)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError(f"{path} is not a Lightning checkpoint: it has no 'state_dict'")
    optimizer_states = checkpoint.get("optimizer_states") or []
    ckpt.load_full(
        module,
        optimizers[: len(optimizer_states)],
        checkpoint["state_dict"],
        optimizer_states[: len(optimizers)],
        strict=strict,
    )
    return checkpoint


_VERSION = re.compile(r"\.(?P<name>.+)\.(v|old)-[0-9a-f]{8}")  # commit's complete versions


def recover_last(trainer: Any) -> None:
    """Collective, at setup: a `last` checkpoint of a `ModelCheckpoint` whose name a killed save
    left missing (a real directory moved aside on a filesystem without an atomic directory
    exchange) is put back, and the run stops on every rank saying so.

    Lightning resolves `ckpt_path="last"` by listing the folder before the strategy runs: it
    found no `last*.ckpt` and would start from step 0, unsaid, with complete checkpoints beside.
    (A name that holds an older checkpoint than a complete version beside it is moved to the
    newest when it is loaded: `core.weights.checkpoint.load_checkpoint`.)"""
    problem = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        for callback in trainer.checkpoint_callbacks:
            folder = getattr(callback, "dirpath", None)
            if not isinstance(callback, ModelCheckpoint) or not folder or not Path(folder).is_dir():
                continue
            names = {m["name"] for p in Path(folder).iterdir() if (m := _VERSION.fullmatch(p.name))}
            for name in sorted(names):
                last = re.match(rf"^{callback.CHECKPOINT_NAME_LAST}", Path(name).stem)
                path = Path(folder) / name
                missing = last and name.endswith(callback.FILE_EXTENSION) and not path.exists()
                if missing and commit.recover(path):
                    problem = (
                        f"{path} was missing: a save killed while publishing it left the "
                        "complete checkpoint beside it, so ckpt_path='last' found none and "
                        "this run would have started from step 0. It is back under its name "
                        "now: run again, and fit(ckpt_path='last') resumes from it."
                    )
    ckpt.raise_on_every_rank(problem)


class StrategyCheckpoints:
    """What `ZeroPPStrategy`'s checkpoint calls do (`save_checkpoint`, `load_checkpoint`,
    removal, a save in the background waited for), for its `state_dict_type` and `async_save`;
    and the global batch of the checkpoint resumed (`saved_rows`)."""

    def __init__(self, state_dict_type: str, async_save: bool) -> None:
        self.state_dict_type = check_state_dict_type(state_dict_type)
        if async_save and state_dict_type != "sharded":
            raise ValueError(
                f"async_save=True writes sharded checkpoints (state_dict_type='sharded'), not "
                f"state_dict_type={state_dict_type!r}; drop one of the two."
            )
        self.async_ = AsyncCheckpointer() if async_save else None
        self.saved_rows: int | None = None  # the global batch of the checkpoint resumed

    @property
    def sharded(self) -> bool:
        """Whether checkpoints are distributed checkpoint directories (else one full file)."""
        return self.state_dict_type == "sharded"

    def save(
        self,
        path: Path,
        module: pl.LightningModule,
        optimizers: list[torch.optim.Optimizer],
        checkpoint: dict[str, Any],
    ) -> None:
        # The global batch, so that a resume mid-epoch with another one is named (`data`).
        checkpoint = {**checkpoint, data.BATCH_ROWS: data.batch_rows(module.trainer)}
        # A fit a stop ended resumes where it stopped, not an epoch on (`stopped_epoch`).
        checkpoint = stopped_epoch.settle_stopped_epoch(module.trainer, checkpoint)
        if self.state_dict_type == "full":
            export.save_file(path, checkpoint)  # complete on rank 0; tmp file + rename
            return
        checkpoint = {
            k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
        }
        if self.async_ is not None:
            self.async_.save(path, module, optimizers, checkpoint)
            state = module.trainer.state
            if state.fn != TrainerFn.FITTING or state.status != TrainerStatus.RUNNING:
                # Outside a running fit (trainer.save_checkpoint after fit) no later save or
                # teardown would wait for it: the checkpoint must be complete on return.
                self.async_.wait()
            return
        ckpt.save_checkpoint(path, module, optimizers, checkpoint)

    def load(
        self, path: Path, module: pl.LightningModule, optimizers: list[torch.optim.Optimizer]
    ) -> dict[str, Any]:
        if self.async_ is not None:
            self.async_.wait()  # it may be the checkpoint still being written
        # Read as data whatever `weights_only` asks; the module's own hyperparameters' classes
        # (built in this process already) may come back.
        trusted = trust.trusted_types(dict(module.hparams))
        if path.is_file():  # a full checkpoint (state_dict_type="full", or consolidated)
            loaded = load_full_file(path, module, optimizers, trusted, module.strict_loading)
        else:
            loaded = ckpt.load_checkpoint(path, module, optimizers, trusted)
        self.saved_rows = loaded.get(data.BATCH_ROWS)
        # A settled epoch start, as the resumed fit's loops restart it (`stopped_epoch`).
        return stopped_epoch.restart_at_epoch_start(module.trainer, loaded)

    def wait(self) -> None:
        """The last checkpoint complete (an async save written)."""
        if self.async_ is not None:
            self.async_.wait()

    def remove(self, filepath: Any, is_global_zero: bool) -> None:
        if self.async_ is not None:  # not before the save that replaces it is complete
            self.async_.remove(filepath)
        elif is_global_zero:
            commit.remove(filepath)
