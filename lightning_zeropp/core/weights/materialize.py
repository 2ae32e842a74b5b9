"""Build a model with no memory, then give each rank only its own shards.

A model too large for one process is built with its parameters on the meta device
(`empty_parameters()`, Accelerate's `init_empty_weights()`, or `torch.device("meta")`), split
and sharded as it is, and only then materialized (`to_empty` on the sharded stages: each rank
allocates its own shards). Its values come from a checkpoint (`core.load_weights`) or from the
model's own initialization, run module by module (`init_modules`):

- the init is `init(module)` per module (HF's `_init_weights` shape), by default the model's own
  `_init_weights` (HF models) or each module's `reset_parameters()` (torch layers);
- each module is initialized at full size in a scratch copy of its own tensors, and every rank
  keeps its rows: the peak is the largest single module, never the model;
- the random stream of a module is seeded by its name and one seed (rank 0's `initial_seed()`),
  so the values do not depend on the layout: pp 2 x dp 2 and one process (`init_weights`) give
  the same model. They are not the values an eager build draws from the global stream, which
  visits the modules of every stage in order.

Nothing is left silently unset: every materialized tensor is filled with NaN first and checked
after, and an init that writes into a submodule's sharded tensors (it would reach shards, not
whole tensors) is refused; both errors name the tensor and the fix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lightning_zeropp.core.shard.fsdp import local_shard
from lightning_zeropp.core.split.tied import TiedWeights
from lightning_zeropp.core.weights.collective import raise_on_every_rank
from lightning_zeropp.core.weights.init_modules import (
    InitFn,
    check_set,
    init_stage,
    named_tensors,
    own_named,
    shared_seed,
)
from lightning_zeropp.core.weights.init_record import follow_parameter, recording, tape_of
from lightning_zeropp.core.weights.init_tape import replay_into, unrecorded
from lightning_zeropp.core.weights.load import load_weights

__all__ = [
    "InitFn",
    "Source",
    "fill_values",
    "empty_parameters",
    "has_meta",
    "materialize",
    "non_persistent",
    "real_to",
]


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Create every parameter on the meta device (no memory); buffers stay real.

    Buffers are small and often computed at construction (rotary tables), which no checkpoint
    holds: keeping them is what lets a model built here load from one without an init.
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kind = type(param)
            meta = kind(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta
            follow_parameter(meta)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        with recording():  # the init the constructor applies, for `fill_values` to replay
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` is on the meta device."""
    tensors = [*module.parameters(), *module.buffers()]
    return any(t.device.type == "meta" for t in tensors)


@dataclass
class Source:
    """Where a model's values come from: `load_from` (a checkpoint) or `init`; `model` is the
    unsplit model (its tied names, HF's `base_model_prefix`)."""

    init: InitFn
    load_from: str | Path | None
    model: nn.Module
    given: bool = False  # `init` is the user's (else the model's own, `default_init`)


def fill_values(
    stages: Sequence[nn.Module],
    merged: nn.Module,
    device: torch.device,
    meta: bool,
    source: Source,
    tied: TiedWeights,
) -> None:
    """Values for a meta model's shards (init, or a checkpoint), or a checkpoint's over a whole
    model's; `merged` holds `stages` under the model's names. A checkpoint holds no
    non-persistent buffers: those come from the init."""
    load_from = source.load_from
    recorded = tape_of(source.model) if meta and load_from is None and not source.given else None
    if meta:
        only: Callable[[nn.Module, str, torch.Tensor], bool] | None
        only = non_persistent if load_from is not None else None
        if recorded is not None:  # the constructor's init, replayed below, sets these
            only = unrecorded(stages, recorded[1])
        seed = shared_seed(device)
        # A rank whose stages fail raises on every rank (the others would wait in the step).
        raise_on_every_rank(
            _problem(lambda: materialize(stages, device, source.init, seed, only=only))
        )
    if recorded is not None:
        raise_on_every_rank(_problem(lambda: replay_into(stages, recorded, device)))
    if load_from is not None:
        prefix = getattr(source.model, "base_model_prefix", "")
        load_weights(merged, load_from, tied.names(), prefix)
    elif meta:  # each stage drew its own copy of a tied weight: the first stage's wins
        tied.sync_values()
    if meta:
        raise_on_every_rank(_problem(lambda: check_set(stages)))


def _problem(run: Callable[[], None]) -> str | None:
    try:
        run()
    except ValueError as err:
        return str(err)
    return None


@torch.no_grad()
def materialize(
    stages: Sequence[nn.Module],
    device: torch.device,
    init: InitFn | None,
    seed: int,
    *,
    only: Callable[[nn.Module, str, torch.Tensor], bool] | None = None,
) -> None:
    """Allocate this rank's shards of sharded meta `stages` (real buffers kept), filled with NaN.

    With `init`, run it module by module on the tensors that were on the meta device (only those
    `only(module, name, tensor)` accepts, when given) and keep this rank's rows. Call
    `check_set` once their values are all in (after a load, say).
    """
    for stage in stages:
        kept = _real_tensors(stage)
        stage.to_empty(device=device)
        born = _meta_names(stage, kept)
        for module, name, value in kept:  # to_empty replaced them too
            if name in module._parameters:
                param = module._parameters[name]
                assert param is not None  # `kept` holds real tensors only
                local_shard(param).copy_(value)
            else:
                module._buffers[name] = value.to(device)
        for module_name, name, t in named_tensors(stage):
            if t.is_floating_point() and (module_name, name) in born:
                local_shard(t).fill_(float("nan"))
        if init is not None:
            init_stage(stage, init, seed, only, born)


def real_to(module: nn.Module, device: torch.device) -> None:
    """Move the tensors of a partly meta module that are not on the meta device."""
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None and not p.is_meta and p.device != device:
                sub._parameters[name] = nn.Parameter(p.to(device), p.requires_grad)
        for name, b in sub._buffers.items():
            if b is not None and not b.is_meta:
                sub._buffers[name] = b.to(device)


def non_persistent(module: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Tensors no checkpoint holds (`materialize`'s `only=` when the values are loaded)."""
    return name in module._non_persistent_buffers_set


# ---------------------------------------------------------------------- internals
def _real_tensors(stage: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every tensor not on the meta device, to put back after `to_empty`: buffers as they are,
    parameters as a copy of this rank's shard (FSDP2 gives the module new ones)."""
    kept = []
    for module in stage.modules():
        for name, t in own_named(module):
            if not t.is_meta:
                kept.append(
                    (module, name, local_shard(t).clone() if name in module._parameters else t)
                )
    return kept


def _meta_names(
    stage: nn.Module, kept: list[tuple[nn.Module, str, torch.Tensor]]
) -> set[tuple[str, str]]:
    """(module name, tensor name) of every tensor that was born on the meta device."""
    kept_ids = {(id(m), n) for m, n, _ in kept}
    return {
        (module_name, name)
        for module_name, module in stage.named_modules()
        for name, _ in own_named(module)
        if (id(module), name) not in kept_ids
    }
