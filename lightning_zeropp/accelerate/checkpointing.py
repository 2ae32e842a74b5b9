"""Checkpoints in the Accelerate front: `accelerator.save_state` / `load_state`, with the model
and optimizer sharded, committed atomically.

`save_state(dir)` writes Accelerate's own files (the scheduler, RNG states, registered objects)
and, through its save pre-hook, the sharded model and optimizer as a distributed checkpoint in
`dir/zeropp` (`save_sharded`: each rank writes its shards; loadable under any layout, the names
being the model's own). The folder is written as a temporary sibling and renamed into place when
every rank has finished (`commit_state`, `core.weights.commit`), so a named folder always holds a
complete state. `load_state(dir)` reads it back through the load pre-hook (`load_sharded`).

Every file `load_state` reads is read as data. Accelerate reads its registered objects
(`custom_checkpoint_<i>.pkl`: the scheduler, the user's objects) with `weights_only=False`; the
front's `load_state` runs it under torch's switch forcing `weights_only=True`, and before any of
it the load pre-hook (`check_state_files`) checks the folder's checksums (`SHA256SUMS`, written at
save) and reads each file as data, naming one that would run code. Accelerate drops an unreadable
RNG state (`random_states_<i>.pkl`) without a word; here it is an error naming the file and the
fix, and a missing one a warning.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils.constants import RNG_STATE_NAME
from accelerate.utils.other import TORCH_SAFE_GLOBALS
from torch import nn
from torch.optim import Optimizer

from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.step import resumed_rows
from lightning_zeropp.core.weights import checkpoint as ckpt
from lightning_zeropp.core.weights import checksum, commit, trust

__all__ = [
    "BATCHES",
    "CHECKPOINT_DIR",
    "EPOCH",
    "ROWS",
    "check_loaded_rows",
    "check_skipped_rows",
    "epoch_batches",
    "global_rows",
    "check_state_files",
    "commit_state",
    "load_sharded",
    "save_sharded",
]

CHECKPOINT_DIR = "zeropp"  # the sharded model + optimizer checkpoint inside save_state's folder
# in its metadata: rows of one training loader batch over all processes, and the training
# batches the pipelined model ran (SIGTERM's step numbers continue from them after a resume)
# and the training loader's batches per epoch
ROWS, BATCHES, EPOCH = "zeropp_batch_rows", "zeropp_training_batches", "zeropp_epoch_batches"


def save_sharded(
    output_dir: str | os.PathLike[str],
    module: nn.Module,
    optimizer: Optimizer,
    config: ZeroPPLayout,
    record: dict[str, Any] | None = None,
) -> Path:
    """Collective: write the sharded model and optimizer state to `output_dir/zeropp`;
    `record`: plain values the front keeps in its metadata (`ROWS`, `BATCHES`)."""
    meta = {"zeropp_config": _plain(config), "world_size": dist.get_world_size(), **(record or {})}
    with _nonempty_groups(optimizer):
        return ckpt.save_checkpoint(Path(output_dir) / CHECKPOINT_DIR, module, [optimizer], meta)


def load_sharded(
    input_dir: str | os.PathLike[str], module: nn.Module, optimizer: Optimizer
) -> dict[str, Any]:
    """Collective: read what `save_sharded` wrote (under any layout: names are the model's own)."""
    path = Path(input_dir) / CHECKPOINT_DIR
    if not ckpt.is_checkpoint(path):
        raise FileNotFoundError(
            f"{input_dir} holds no ZeroPP checkpoint ({path} is missing); save it with "
            "accelerator.save_state after prepare_pipeline."
        )
    with _nonempty_groups(optimizer):
        meta = ckpt.load_checkpoint(path, module, [optimizer])
    _fill_empty_groups(optimizer)
    return meta


def global_rows(loader: Any, split_batches: bool, processes: int) -> int | None:
    """Rows of one batch of the training `loader` (as the loop gave it to `prepare`) over all
    processes, as DDP reads them; None if the loader does not say its batch size."""
    size = getattr(loader, "batch_size", None)
    if not isinstance(size, int):
        return None
    return size if split_batches else size * processes


def epoch_batches(loader: Any) -> int | None:
    """Batches of one epoch of the prepared training loader (None: a stream without a length)."""
    try:
        return len(loader)
    except TypeError:
        return None


_FIX = (
    "Prepare the training loader with the batch size the state was saved with (the same "
    "number of processes), or resume from a state saved at the end of an epoch."
)


def check_loaded_rows(input_dir: str | None, loaded: dict[str, Any], rows: int | None) -> None:
    """Refuse (every rank: the same checkpoint and loader) a `load_state` of a state saved
    mid-epoch with another global batch than this run's `rows`: however the loop counts the
    batches to skip, they are not the trained rows. (A loop computing its epoch from the count,
    as run_clm does, would otherwise skip whole epochs without a word.)"""
    epoch, done = loaded.get(EPOCH), int(loaded.get(BATCHES, 0))
    into = done % epoch if epoch else 0
    where = f"load_state({input_dir!r}) resumes {into} batches into an epoch"
    resumed_rows.check_resumed_rows(into, loaded.get(ROWS), rows, where, fix=_FIX)


def check_skipped_rows(count: int, loaded: dict[str, Any], rows: int | None) -> None:
    """Refuse `skip_first_batches(loader, count)` after a `load_state` saved with another
    global batch than this run's `rows` (every rank: the same numbers)."""
    where = f"skip_first_batches(train_dataloader, {count}) after load_state"
    resumed_rows.check_resumed_rows(count, loaded.get(ROWS), rows, where, fix=_FIX)


def commit_state(
    accelerator: Accelerator, output_dir: str | None, save: Callable[[str], Any]
) -> str:
    """`Accelerator.save_state`, committed atomically (`core.weights.commit`): `save(folder)` is
    the base class's `save_state`, run into a temporary folder.

    A named `output_dir` always holds a complete state (the previous one until the new one
    is). Under `ProjectConfiguration(automatic_checkpoint_naming=True)` the state is written
    outside `checkpoints/` and renamed in as `checkpoint_<iteration>`, so Accelerate's own
    `load_state()` (the newest folder) never meets a half-written one; `total_limit` prunes
    as Accelerate does.
    """
    project = accelerator.project_configuration
    automatic = project.automatic_checkpoint_naming
    if automatic:
        final = (
            Path(accelerator.project_dir)
            / "checkpoints"
            / f"checkpoint_{accelerator.save_iteration}"
        )
        if final.exists():
            raise ValueError(
                f"Checkpoint directory {final} ({accelerator.save_iteration}) already exists; set "
                "accelerator.project_configuration.iteration to the next free number."
            )
        tmp = Path(accelerator.project_dir) / final.name
    elif output_dir is None:
        raise ValueError("save_state needs output_dir (or automatic_checkpoint_naming)")
    else:
        final = tmp = Path(output_dir)
    if accelerator.is_main_process and automatic:
        _prune(final.parent, project.total_limit)
    # One temporary for all ranks, made before its name is shared: each writes its files in.
    tmp = ckpt.prepare_save(tmp)
    project.automatic_checkpoint_naming = False  # write where told: the temporary
    try:
        save(str(tmp))
    finally:
        project.automatic_checkpoint_naming = automatic
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        checksum.write_folder_sums(tmp)  # Accelerate's files, checked before load_state reads
        final.parent.mkdir(parents=True, exist_ok=True)
        commit.publish(tmp, final, link=not automatic)
    accelerator.wait_for_everyone()
    return str(final)


def check_state_files(input_dir: str | os.PathLike[str], process_index: int) -> None:
    """Collective (the load pre-hook): raise on every rank, naming the file, if a file of
    `input_dir` that `load_state` reads changed since the save, would run code, or (this
    process's RNG state) does not restore a random state; warn if the RNG state is missing."""
    folder = Path(input_dir)
    try:
        problem = checksum.verify(folder, 0, 1)
        if problem is None:
            for file in sorted(folder.iterdir()):
                if file.is_file() and file.suffix in (".pkl", ".bin"):
                    trust.read_data(file, allowed=TORCH_SAFE_GLOBALS)
            _check_rng_state(folder / f"{RNG_STATE_NAME}_{process_index}.pkl")
    except ValueError as err:
        problem = str(err)
    ckpt.raise_on_every_rank(problem)


def _check_rng_state(file: Path) -> None:
    if not file.is_file():
        warnings.warn(
            f"{file} is missing: load_state restores no random state for this process (dropout "
            "and shuffling differ from an uninterrupted run). Saved with fewer processes?",
            stacklevel=3,
        )
        return
    fix = (
        "Delete it to resume without restoring the random state (dropout and shuffling then "
        "differ from an uninterrupted run), or load another checkpoint."
    )
    states = trust.read_data(file, allowed=TORCH_SAFE_GLOBALS)
    try:  # what Accelerate sets from it, tried here: Accelerate would drop it without a word
        random.Random().setstate(states["random_state"])
        torch.Generator().set_state(states["torch_manual_seed"])
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise ValueError(
            f"{file} does not restore the random state ({type(err).__name__}: {err}): it was "
            f"edited or replaced. {fix}"
        ) from None


def _prune(folder: Path, total_limit: int | None) -> None:
    """Make room for one more `checkpoint_<n>` under `total_limit`, oldest first (Accelerate's
    rule, applied to the committed folders only)."""
    if total_limit is None or not folder.is_dir():
        return
    saved = [p for p in folder.iterdir() if re.fullmatch(r"checkpoint_\d+", p.name)]
    saved.sort(key=lambda p: int(p.name.split("_")[1]))
    for old in saved[: max(0, len(saved) + 1 - total_limit)]:
        commit.remove(old)


# ------------------------------------------------------------------------------------ helpers
@contextlib.contextmanager
def _nonempty_groups(optimizer: Optimizer) -> Iterator[None]:
    """Hide param groups that are empty on this rank from the distributed checkpoint.

    Groups stay aligned across ranks, so a group may hold no parameter of this rank's stages;
    torch's flattened optimizer state dict cannot load such a group (it reads the group's
    hyperparameters from its first parameter). Loading replaces the group dicts it sees, so the
    full list is rebuilt from the loaded ones afterwards.
    """
    groups = optimizer.param_groups
    optimizer.param_groups = [g for g in groups if g["params"]]
    try:
        yield
    finally:
        loaded = iter(optimizer.param_groups)
        optimizer.param_groups = [next(loaded) if g["params"] else g for g in groups]


def _fill_empty_groups(optimizer: Optimizer) -> None:
    """Give groups that are empty here the hyperparameters another rank loaded for them.

    The checkpoint keeps a group's hyperparameters (its learning rate, ...) with its parameters,
    so a rank holding none of them has nothing to load. Schedulers that update the learning rate
    from its current value (cosine annealing's recursive form) would then drift on that rank.
    """
    mine = [
        {k: v for k, v in g.items() if k != "params"} if g["params"] else None
        for g in optimizer.param_groups
    ]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for i, group in enumerate(optimizer.param_groups):
        if not group["params"]:
            loaded = next((r[i] for r in everyone if r[i] is not None), None)
            if loaded is not None:
                group.update(loaded)


def _plain(config: ZeroPPLayout) -> dict[str, Any]:
    """The config as plain values (dtypes as strings) for the checkpoint's metadata."""
    return {k: str(v) if isinstance(v, torch.dtype) else v for k, v in vars(config).items()}
