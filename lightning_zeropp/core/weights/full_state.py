"""Whole (unsharded) state into this rank's shards: the other direction of `core.weights.export`.

`load_full`: every rank reads one whole state (the model's `state_dict()`, an optimizer's
one-process `state_dict()`) and keeps its own shards, without communication but for agreeing on
the names first (a name missing on one rank fails on every rank).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_zeropp.core.split.tied import local_ties
from lightning_zeropp.core.weights.collective import all_gather, raise_on_every_rank

__all__ = ["load_full", "other_sizes"]

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def load_full(
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    model_state: dict[str, torch.Tensor],
    optimizer_states: list[dict[str, Any]],
    strict: bool = True,
) -> None:
    """Collective: load whole (unsharded) state into this rank's shards, in place.

    Every rank passes the same `model_state` (keyed as `module.state_dict()` of the unsplit
    model) and `optimizer_states`, one per optimizer: one-process `optimizer.state_dict()`s,
    matched by their groups' `param_names` or else by numbering the unsplit model's parameters
    (in `model_state`'s order) group after group, or flattened ones
    (`state.<name>.<key>`, `param_groups.<name>.<key>`). Each rank slices its own shards without
    communication. With `strict`, a name missing on either side raises (on every rank); a
    parameter of `optimizers` missing from its saved state always does.
    """
    local: dict[str, Any] = get_model_state_dict(module, options=_OPTIONS)
    params: dict[torch.Tensor, str] = {param: name for name, param in module.named_parameters()}
    ties = list(local_ties(module).values())
    everywhere = all_gather((list(local), list(params.values()), ties))
    held = {name for state_names, _, _ in everywhere for name in state_names}
    all_params = {name for _, param_names, _ in everywhere for name in param_names}
    all_ties = {tie for _, _, rank_ties in everywhere for tie in rank_ties}
    # One process's optimizer numbers a tied weight once, at its first name.
    later = {name for tie in all_ties for name in tie[1:]}
    param_order = [name for name in model_state if name in all_params and name not in later]
    by_name = [_optimizer_state_by_name(saved, param_order) for saved in optimizer_states]
    for saved in by_name:  # every copy of a tied weight takes the state saved for it
        for tie in all_ties:
            if (found := next((n for n in tie if n in saved), None)) is not None:
                for name in tie:
                    saved.setdefault(name, saved[found])
    missing = [name for name in local if name not in model_state] if strict else []
    missing += [
        f"optimizer {i}: {params[p]}"
        for i, (opt, saved) in enumerate(zip(optimizers, by_name, strict=True))
        for group in opt.param_groups
        for p in group["params"]
        if params[p] not in saved
    ]
    unexpected = [name for name in model_state if name not in held] if strict else []
    raise_on_every_rank(_naming_problem(missing, unexpected) or _size_problem(model_state, local))
    shards: dict[str, Any] = {  # Any: torch annotates the argument as an invariant dict
        name: _shard_like(model_state[name], like)
        for name, like in local.items()
        if name in model_state
    }
    set_model_state_dict(module, shards, options=StateDictOptions(strict=strict))
    for opt, saved in zip(optimizers, by_name, strict=True):
        _load_optimizer(opt, params, saved)


def _size_problem(model_state: dict[str, Any], local: dict[str, Any]) -> str | None:
    """A whole state of another size than this rank's part of the model, in one line (a DTensor's
    shape is the whole tensor's)."""
    differ = [
        (name, model_state[name].shape, like.shape)
        for name, like in local.items()
        if name in model_state
        and torch.is_tensor(like)
        and tuple(model_state[name].shape) != tuple(like.shape)
    ]
    return other_sizes("the checkpoint", differ)


def other_sizes(checkpoint: str, differ: list[tuple[str, Any, Any]]) -> str | None:
    """One line for tensors saved with another size than the model's (name, saved, model size):
    the first of them and how many more."""
    if not differ:
        return None
    name, saved, model = differ[0]
    more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
    return (
        f"{checkpoint} has `{name}` {list(saved)}, the model {list(model)}{more}: it was saved "
        "from another model"
    )


def _optimizer_state_by_name(
    saved: dict[str, Any], param_order: list[str]
) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """{parameter name: (its state, its group's hyperparameters)} from a saved optimizer state."""
    out: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    if "param_groups" not in saved:  # flattened
        for key, value in saved.items():
            kind, _, rest = key.partition(".")
            name, _, field = rest.rpartition(".")
            out.setdefault(name, ({}, {}))[0 if kind == "state" else 1][field] = value
        return out
    for group in saved["param_groups"]:
        ids = group["params"]
        if "param_names" in group:
            names = group["param_names"]
        elif max(ids, default=-1) < len(param_order):
            names = [param_order[i] for i in ids]
        else:
            raise ValueError(
                f"the optimizer state numbers {max(ids) + 1} parameters, the model has "
                f"{len(param_order)}: it was saved for another model"
            )
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        for i, name in zip(ids, names, strict=True):
            out[name] = (saved["state"].get(i, {}), hyper)
    return out


def _load_optimizer(
    optimizer: torch.optim.Optimizer,
    names: dict[torch.Tensor, str],
    saved: dict[str, tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    """`optimizer.load_state_dict` with this rank's parameters' slices of the saved state."""
    state: dict[int, dict[str, Any]] = {}
    groups = []
    next_id = 0
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        ids = list(range(next_id, next_id + len(group["params"])))
        next_id += len(ids)
        for i, param in zip(ids, group["params"], strict=True):
            values, saved_hyper = saved[names[param]]
            hyper |= saved_hyper
            if values:
                state[i] = {
                    k: _shard_like(v, param) if torch.is_tensor(v) and v.shape == param.shape else v
                    for k, v in values.items()
                }
        groups.append({**hyper, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full`, laid out as `like` (a DTensor shard, or a whole tensor)."""
    if isinstance(like, DTensor):
        # src_data_rank=None: every rank holds `full` and slices its own piece, no communication.
        full = distribute_tensor(
            full.to(like.device), like.device_mesh, like.placements, src_data_rank=None
        )
    # A copy, not a view: the piece must not keep the whole tensor (or a mapped file) alive.
    return full.clone()


def _naming_problem(missing: list[str], unexpected: list[str]) -> str | None:
    parts = [
        f"{len(names)} {kind} ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
        for kind, names in (("missing", missing), ("unexpected", unexpected))
        if names
    ]
    return "the checkpoint does not fit this model: " + "; ".join(parts) if parts else None
