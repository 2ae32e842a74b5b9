"""What `ZeroPPAccelerator.prepare` reads and builds around the pipeline: the training loader's
example batch as the pipeline calls the model (`unpack_call`), the whole model's structure kept for
`unwrap_model` (`skeleton`, `tied_names`), Accelerate's process state checked (`check_state_made_
before`), and which prepared objects are schedulers."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zeropp.core.split.tied import tied_groups
from lightning_zeropp.fronts.hf_loss import NUM_ITEMS

__all__ = [
    "check_state_made_before",
    "is_scheduler",
    "length",
    "skeleton",
    "tied_names",
    "unpack_call",
]


def unpack_call(token_weighted: bool) -> Any:
    """The example batch as the pipeline will call the model: `model(**batch)`, plus the
    `num_items_in_batch` it adds (HF passes it down to every block: the split's check must see
    the same block call)."""

    def unpack(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        if not isinstance(batch, Mapping):  # HF's BatchEncoding is a Mapping, not a dict
            raise TypeError(
                f"ZeroPPAccelerator's training loader yields {type(batch).__name__}; it expects "
                "dict batches called as model(**batch) (HF collators). For other batches use "
                "prepare_pipeline(..., unpack=...)."
            )
        kwargs = dict(batch)
        if token_weighted:
            kwargs.setdefault(NUM_ITEMS, 1.0)
        return (), kwargs, batch.get("labels")

    return unpack


def skeleton(model: nn.Module) -> nn.Module:
    """A copy of `model` with its parameters on the meta device (no memory) and its buffers
    real: non-persistent buffers (rotary tables) are in no state dict, so unwrap_model could
    not fill them in later."""
    memo: dict[int, Any] = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        for p in model.parameters()
    }
    return copy.deepcopy(model, memo)


def tied_names(model: nn.Module) -> list[tuple[str, ...]]:
    """The names of each parameter `model` holds under several names, in model order (frozen
    ties included)."""
    return tied_groups(model, frozen=True)


def check_state_made_before(made_before: bool, processes: int) -> None:
    """Accelerate keeps one process state (`PartialState`), made by whatever reads it first; made
    before this accelerator without `cpu=True` on CPUs, it is one process whatever this
    accelerator's `cpu=True` says, and the generic advice (pass cpu=True) would be wrong."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if made_before and processes == 1 and world > 1:
        raise ValueError(
            f"WORLD_SIZE={world} but Accelerate's process state says one process: it was made "
            "before the ZeroPPAccelerator, without cpu=True (a tracker built first does this: "
            "GeneralTracker methods marked @on_main_process read PartialState()), and an "
            "Accelerator's own cpu=True cannot change it afterwards. Make the state first: "
            "`from accelerate import PartialState; PartialState(cpu=True)` before building the "
            "tracker."
        )


def length(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        return len(value)
    return value.shape[0] if isinstance(value, torch.Tensor) and value.dim() > 0 else None


def is_scheduler(obj: Any) -> bool:
    return isinstance(getattr(obj, "optimizer", None), Optimizer) and hasattr(obj, "step")
