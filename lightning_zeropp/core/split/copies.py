"""Copies of a model for its pipeline stages: what is copied and what stays shared.

A stage is a deep copy of the modules it runs. The model root's own plain attributes (an HF
`config`, a LightningModule's hyperparameters, tokenizer or data, a device mesh) are not part of
any stage's computation state, may be large and may not copy at all (locks, open files): every
copy shares them with the model. The module machinery (parameters, buffers, submodules, hooks)
is copied, so sharding a stage or registering a hook on it never touches the model or another
stage.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["meta_copy", "shared_memo", "stage_copy"]

# What every nn.Module holds in its __dict__: copied, never shared.
_MODULE_STATE = frozenset(nn.Module().__dict__)


def shared_memo(model: nn.Module) -> dict[int, Any]:
    """A `copy.deepcopy` memo that keeps the root's plain attributes shared (see the module
    docstring)."""
    return {
        id(value): value
        for key, value in vars(model).items()
        if key not in _MODULE_STATE and not isinstance(value, nn.Module)
    }


def stage_copy(model: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """`copy.deepcopy(model, memo)` with the root's plain attributes shared."""
    return copy.deepcopy(model, {**shared_memo(model), **memo})


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers live on the meta device (no memory)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return stage_copy(model, memo)
