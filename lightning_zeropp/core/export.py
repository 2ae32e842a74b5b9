"""Consolidated export: the whole trained model as one plain state dict, written by rank 0.

Distributed checkpoints (`core.checkpoint`) stay sharded, for resuming. An export is for the world
outside: every stage's every shard gathered to global rank 0 as plain CPU tensors keyed by the
model's original parameter names, then handed to a writer (the HF adapter writes `config.json` +
`model.safetensors`). Everything here is collective: every rank calls it, with the same arguments.

Gathering streams one tensor at a time: within a pipeline stage, the data-parallel ranks all-gather
each sharded tensor and only the stage's first data-parallel rank keeps a CPU copy, so no device
ever holds more than one full tensor at once. The stages' leaders then send their CPU tensors to
global rank 0 (the first stage's leader: ranks are laid out pp-major).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from lightning_zeropp.core.checkpoint import _swap_into_place
from lightning_zeropp.core.mesh import ParallelDims

__all__ = ["full_state_dict", "save_consolidated"]


def full_state_dict(module: nn.Module, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """Collective: the whole model's state on global rank 0 (an empty dict on other ranks).

    `module` is this rank's stages (the engine's `module`, or what a front put in the model's
    place); `dims` the mesh it was sharded over. Values are contiguous CPU tensors that share no
    storage, keyed by the names the unsplit model had.
    """
    # Sharded view (DTensors, original names): FSDP2-aware, as in core.checkpoint.
    sharded = get_model_state_dict(module, options=StateDictOptions(full_state_dict=False))
    leader = all(dims.mesh.get_local_rank(axis) == 0 for axis in ("dp_replicate", "dp_shard"))
    local: dict[str, torch.Tensor] = {}
    for name, value in sharded.items():
        # Every data-parallel rank of the stage walks the same names in the same order, so the
        # all-gathers inside full_tensor() line up.
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if leader:
            local[name] = full.detach().to("cpu", copy=True).contiguous()
        del full
    if not leader:
        return {}
    if dims.config.pp_size == 1:
        return local  # the only leader is global rank 0
    # Only the stage leaders (one pipeline group, which holds global rank 0) take part.
    gathered: list[dict[str, torch.Tensor]] | None = (
        [{} for _ in range(dims.config.pp_size)] if dist.get_rank() == 0 else None
    )
    dist.gather_object(local, gathered, group=dims.pp_group, group_dst=0)
    if gathered is None:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        for name, tensor in part.items():
            # Constant buffers may be copied on several stages; parameters never are (tied
            # weights are refused at split time), so the first copy is the copy.
            merged.setdefault(name, tensor)
    return merged


def save_consolidated(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Collective: global rank 0 runs `write(tmp_dir)`, then renames `tmp_dir` to `path`.

    `path` is always either absent, the previous export, or the complete new one. When rank 0
    fails, every rank raises (no rank is left waiting at a barrier). Without a process group
    (one process) it just writes.
    """
    path = Path(path)
    distributed = dist.is_available() and dist.is_initialized()
    error: str | None = None
    original: BaseException | None = None
    if not distributed or dist.get_rank() == 0:
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            tmp.mkdir(parents=True)
            write(tmp)
            _swap_into_place(tmp, path)
        except Exception as err:  # reported to every rank below, then re-raised here
            shutil.rmtree(tmp, ignore_errors=True)
            error, original = f"{type(err).__name__}: {err}", err
    # Doubles as the barrier: nobody returns before rank 0 has renamed the export into place.
    box = [error]
    if distributed:
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise RuntimeError(f"exporting to {path} failed on rank 0: {box[0]}") from original
    return path
