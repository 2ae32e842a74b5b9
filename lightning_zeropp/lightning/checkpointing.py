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
reading it and keeping its own shards. Both are read as data (`core.weights.trust`): a file with
`torch.load(weights_only=True)` whatever `weights_only` Lightning passes, the classes of the
running module's own hyperparameters allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_zeropp.core.weights import checkpoint as ckpt
from lightning_zeropp.core.weights import trust

__all__ = ["STATE_DICT_TYPES", "check_state_dict_type", "load_full_file"]

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
