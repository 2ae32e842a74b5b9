"""Distributed checkpoints: sharded, layout-independent, written atomically.

Model and optimizer state go through torch's distributed checkpoint (DCP) with the model's original
parameter names, so a checkpoint written under one layout loads under another. Optimizer state is
saved flattened (keyed by parameter name): nested per-stage `param_groups` keys would collide across
pipeline stages. The checkpoint is written to a temporary sibling directory and renamed into place
only after every rank has finished, so a crash mid-write never leaves a half checkpoint under the
real name.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["save_checkpoint", "load_checkpoint", "is_checkpoint"]

META_FILE = "meta.pt"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    meta: dict[str, Any] | None = None,
) -> Path:
    """Collective: every rank calls it with the same `path` (on a filesystem all ranks share)."""
    path = Path(path)
    tmp = _broadcast_str(str(path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")))
    dcp.save(_state(model, optimizers), checkpoint_id=tmp)
    if dist.get_rank() == 0:
        torch.save(meta or {}, Path(tmp) / META_FILE)
    dist.barrier()
    if dist.get_rank() == 0:
        _swap_into_place(Path(tmp), path)
    dist.barrier()
    return path


def load_checkpoint(
    path: str | Path, model: nn.Module, optimizers: list[torch.optim.Optimizer]
) -> dict[str, Any]:
    """Load model (and optimizer) state in place; return the non-tensor metadata saved with it."""
    path = Path(path)
    if not is_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a ZeroPP checkpoint directory (no {META_FILE})")
    state = _state(model, optimizers)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"], options=_OPTIONS)
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(model, opt, state[f"optimizer_{i}"], options=_OPTIONS)
    return torch.load(path / META_FILE, weights_only=False)


def _state(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    state: dict[str, Any] = {"model": get_model_state_dict(model, options=_OPTIONS)}
    for i, opt in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(model, opt, options=_OPTIONS)
    return state


def _swap_into_place(tmp: Path, path: Path) -> None:
    """Replace `path` by `tmp` so that `path` is always either the old or the new checkpoint."""
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        path.rename(old)
    tmp.rename(path)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def _broadcast_str(value: str) -> str:
    """Rank 0's string on every rank (temporary names must agree)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
