"""Distributed checkpoints: sharded, layout-independent, written atomically, read as data.

Model and optimizer state go through torch's distributed checkpoint (DCP) with the model's original
parameter names, so a checkpoint written under one layout loads under another. Optimizer state is
saved flattened (keyed by parameter name): nested per-stage `param_groups` keys would collide across
pipeline stages.

Saving: global rank 0 makes the temporary directory (`core.weights.commit`) and writes `meta.pt`
into it before it shares the name; every rank writes its shards and their checksums
(`core.weights.checksum`); when all have, rank 0 writes `SHA256SUMS` and publishes the directory
under its name in one step: the name always holds a complete checkpoint, the previous one until
the new one is. A run's first save into a folder removes the temporaries crashed saves left there.

Loading checks, on every rank and before any value is read: the checksums (naming a changed or
missing file), that no pickle in the checkpoint names code (`core.weights.trust`; `meta.pt` is
read with `weights_only=True` always), and that the checkpoint holds exactly this model's
tensors with their shapes (a deeper or wider model's is refused in one line). Every function
here is collective and runs under the failure board (`core.step.failure`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lightning_zeropp.core.step.failure import guarded
from lightning_zeropp.core.weights import checksum, commit, trust
from lightning_zeropp.core.weights.collective import all_gather, broadcast_str, raise_on_every_rank
from lightning_zeropp.core.weights.full_state import load_full, other_sizes

__all__ = [
    "checkpoint_state",
    "finish_save",
    "is_checkpoint",
    "load_checkpoint",
    "load_full",
    "prepare_save",
    "raise_on_every_rank",
    "save_checkpoint",
    "shape_problem",
]

META_FILE = "meta.pt"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_CLEANED: set[Path] = set()  # folders whose crashed saves' temporaries this process removed


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


@guarded
def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    meta: dict[str, Any] | None = None,
) -> Path:
    """Collective: every rank calls it with the same `path` (on a filesystem all ranks share)."""
    path = Path(path)
    tmp = prepare_save(path, meta or {})
    writer = checksum.ChecksumWriter(str(tmp))
    dcp.save(checkpoint_state(model, optimizers), storage_writer=writer)
    dist.barrier()
    if dist.get_rank() == 0:
        finish_save(tmp, path)
    dist.barrier()
    return path


def prepare_save(path: Path, meta: dict[str, Any] | None = None) -> Path:
    """Collective: the temporary directory of a save of `path`, made (with `meta.pt` holding
    `meta`, unless None) by global rank 0 before any other rank learns its name."""
    tmp = commit.temporary(path)
    if dist.get_rank() == 0:
        folder = path.parent.resolve()
        if folder not in _CLEANED:  # the run's first save here: crashed saves' leftovers go
            folder.mkdir(parents=True, exist_ok=True)
            commit.clean_temporaries(folder)
            _CLEANED.add(folder)
        tmp.mkdir(parents=True)
        if meta is not None:
            torch.save(meta, tmp / META_FILE)
    return Path(broadcast_str(str(tmp)))


def finish_save(tmp: Path, path: Path) -> None:
    """On global rank 0, once every rank has written: the checksums, then the name."""
    checksum.write_sums(tmp)
    commit.publish(tmp, path)


@guarded
def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    trusted: Iterable[type] = (),
) -> dict[str, Any]:
    """Load model (and optimizer) state in place; return the non-tensor metadata saved with it
    (`meta.pt`, read with `weights_only=True`: `trusted` classes may appear in it)."""
    path = Path(path)
    if _rank() == 0:
        commit.recover(path)  # a save killed in its one non-atomic window left it aside
    raise_on_every_rank(None)  # doubles as the barrier: nobody looks before the recovery
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist: there is nothing to load")
    if commit.is_temporary(path):
        raise ValueError(
            f"{path} is the temporary of a save that did not finish (its name ends in "
            f"{path.name[path.name.rindex('.') :]}): load the checkpoint under its own name, "
            f"{path.name[1 : path.name.rindex('.')]}."
        )
    if not is_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a ZeroPP checkpoint directory (no {META_FILE})")
    raise_on_every_rank(trust.content_problem(path, _rank(), _world()))
    meta = trust.load_meta(path / META_FILE, trusted)
    state = checkpoint_state(model, optimizers)
    raise_on_every_rank(shape_problem(path, state["model"], all_gather(list(state["model"]))))
    try:
        dcp.load(state, checkpoint_id=str(path), planner=trust.SafeLoadPlanner())
    except CheckpointException as err:  # DCP's wraps every rank's traceback: name the cause
        rank, (cause, _) = next(iter(err.failures.items()))
        raise RuntimeError(
            f"loading the checkpoint {path} failed on rank {rank}: {type(cause).__name__}: {cause}"
        ) from err
    set_model_state_dict(model, state["model"], options=_OPTIONS)
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(model, opt, state[f"optimizer_{i}"], options=_OPTIONS)
    return meta


def shape_problem(
    path: Path, model_state: dict[str, Any], everywhere: list[list[str]] | None = None
) -> str | None:
    """What keeps this rank's part of the model from loading `path`, in one line, or None.

    Read from the checkpoint's metadata before DCP starts, so a checkpoint of another model (or
    another size) is named as such instead of failing inside DCP's planner. `everywhere`: every
    rank's model names (`all_gather`), to refuse a checkpoint holding tensors no rank has (a
    deeper model's).
    """
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing, other = [], []
    for name, value in model_state.items():
        meta = saved.get(f"model.{name}")
        if meta is None:
            missing.append(name)
        elif (
            torch.is_tensor(value)
            and isinstance(meta, TensorStorageMetadata)
            and tuple(meta.size) != tuple(value.shape)
        ):
            other.append((name, meta.size, value.shape))
    if other:
        return other_sizes(f"the checkpoint {path}", other)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return (
            f"the checkpoint {path} lacks {', '.join(missing[:3])}{more}: it was saved from "
            "another model"
        )
    known = {f"model.{n}" for names in everywhere or [] for n in names}
    extra = sorted(k for k in saved if k.startswith("model.") and k not in known)
    if everywhere is not None and extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        return (
            f"the checkpoint {path} holds {len(extra)} tensors this model lacks "
            f"({', '.join(k.removeprefix('model.') for k in extra[:3])}{more}): it was saved from "
            "another model (a deeper or wider one); build the model it was saved from"
        )
    return None


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def checkpoint_state(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """What DCP saves and loads: the model's state and each optimizer's, flattened."""
    state: dict[str, Any] = {"model": get_model_state_dict(model, options=_OPTIONS)}
    for i, opt in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(model, opt, options=_OPTIONS)
    return state
