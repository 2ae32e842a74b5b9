"""Build a model with no memory, then give each rank only its own shards.

A model too large for one process is built with its parameters on the meta device
(`empty_parameters()`, Accelerate's `init_empty_weights()`, or `torch.device("meta")`), split
and sharded as it is, and only then materialized (`to_empty` on the sharded stages: each rank
allocates its own shards). Its values come from a checkpoint (`core.load_weights`) or from the
model's own initialization, run here module by module:

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
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_zeropp.core._torch_private import local_chunk, tensor_version
from lightning_zeropp.core.shard.fsdp import local_shard
from lightning_zeropp.core.split.tied import TiedWeights
from lightning_zeropp.core.weights.collective import raise_on_every_rank
from lightning_zeropp.core.weights.init_record import follow_parameter, recording, tape_of
from lightning_zeropp.core.weights.init_tape import replay_into, unrecorded
from lightning_zeropp.core.weights.load import load_weights

__all__ = [
    "InitFn",
    "Source",
    "fill_values",
    "empty_parameters",
    "has_meta",
    "default_init",
    "init_weights",
    "materialize",
    "non_persistent",
    "real_to",
    "shared_seed",
]

InitFn = Callable[[nn.Module], None]


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


def default_init(model: nn.Module) -> InitFn:
    """The model's own init: HF's `_init_weights(module)`, else each `reset_parameters()`."""
    hf = getattr(model, "_init_weights", None)
    if callable(hf):
        return hf
    return _reset_parameters


def _reset_parameters(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def shared_seed(device: torch.device) -> int:
    """Rank 0's `torch.initial_seed()` on every rank (replicas must draw the same values)."""
    seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    return int(seed.item())


def init_weights(model: nn.Module, init: InitFn | None = None, seed: int | None = None) -> None:
    """Initialize a whole (unsharded) model's parameters in place as the meta path does.

    The one-process reference of `materialize`: same seed, same per-module streams, the same
    values whatever the layout. Buffers keep their built values (the init may recompute them).
    """
    seed = torch.initial_seed() % 2**62 if seed is None else seed
    fill = init or default_init(model)
    done: set[int] = set()
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in done]
        if not own:
            continue
        with torch.no_grad():
            for p in own:
                if p.is_floating_point():
                    p.fill_(float("nan"))
        _seeded(fill, module, _module_seed(seed, name))
        done.update(id(p) for p in own)
    check_set([model])


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
        for module_name, name, t in _tensors(stage):
            if t.is_floating_point() and (module_name, name) in born:
                local_shard(t).fill_(float("nan"))
        if init is not None:
            _init_stage(stage, init, seed, only, born)


def check_set(stages: Sequence[nn.Module]) -> None:
    """Raise naming the first tensor nothing set (still NaN after materialize's fill)."""
    for stage in stages:
        for module_name, name, t in _tensors(stage):
            local = local_shard(t)
            if t.is_floating_point() and local.numel() and bool(torch.isnan(local).any()):
                full = f"{module_name}.{name}" if module_name else name
                raise ValueError(
                    f"'{full}' was built on the meta device and nothing set its values: the init "
                    f"left it unset, or the checkpoint does not hold it. Give an init= that sets "
                    "every tensor of each module it is called with (or a checkpoint that has "
                    "it); a buffer computed at construction is kept when the model is built "
                    "under lightning_zeropp.empty_parameters() instead of torch.device('meta')."
                )


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
def _init_stage(
    stage: nn.Module,
    init: InitFn,
    seed: int,
    only: Callable[[nn.Module, str, torch.Tensor], bool] | None,
    born: set[tuple[str, str]],
) -> None:
    """Initialize each module's own meta-born tensors at full size, keep this rank's rows."""
    # Only meta-born tensors are watched: an init may rightly reset a kept buffer of its own.
    watched = [(m, n, t) for m, n, t in _tensors(stage) if (m, n) in born]
    versions = {id(t): tensor_version(local_shard(t)) for _, _, t in watched}
    written: dict[int, int] = {}
    done: set[int] = set()
    for module_name, module in stage.named_modules():
        own = [
            (name, t)
            for name, t in _own_named(module)
            if (module_name, name) in born
            and id(t) not in done
            and (only is None or only(module, name, t))
        ]
        if not own:
            continue
        scratch = {name: _scratch(t) for name, t in own}
        with _swapped(module, scratch):
            _seeded(init, module, _module_seed(seed, module_name))
        for name, t in own:
            local_shard(t).copy_(scratch[name][local_chunk(t)])
            done.add(id(t))
            written[id(t)] = written.get(id(t), 0) + 1
    for module_name, name, t in watched:
        if tensor_version(local_shard(t)) != versions[id(t)] + written.get(id(t), 0):
            full = f"{module_name}.{name}" if module_name else name
            raise ValueError(
                f"the init wrote into '{full}' while initializing another module (a parent's "
                "init reaching into its submodules): on the meta path each module is "
                "initialized alone, on whole copies of its own tensors. Give an init= that "
                "sets only the tensors of the module it is called with."
            )


def _seeded(init: InitFn, module: nn.Module, seed: int) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        init(module)


def _module_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**62


def _scratch(t: torch.Tensor) -> torch.Tensor:
    """A whole, unsharded NaN-filled copy for one module's init to write into."""
    full = torch.empty(t.shape, dtype=t.dtype, device=local_shard(t).device)
    if full.is_floating_point():
        full.fill_(float("nan"))
    return (
        nn.Parameter(full, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else full
    )


@contextlib.contextmanager
def _swapped(module: nn.Module, scratch: dict[str, torch.Tensor]) -> Iterator[None]:
    saved: dict[str, tuple[str, Any]] = {}
    for name, t in scratch.items():
        where = "_parameters" if name in module._parameters else "_buffers"
        saved[name] = (where, getattr(module, where)[name])
        getattr(module, where)[name] = t
    try:
        yield
    finally:
        for name, (where, t) in saved.items():
            getattr(module, where)[name] = t


def _own_named(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    params = [(n, p) for n, p in module._parameters.items() if p is not None]
    return params + [(n, b) for n, b in module._buffers.items() if b is not None]


def _tensors(stage: nn.Module) -> Iterable[tuple[str, str, torch.Tensor]]:
    """(module name, tensor name, tensor) of every distinct tensor of `stage`."""
    seen: set[int] = set()
    for module_name, module in stage.named_modules():
        for name, t in _own_named(module):
            if id(t) not in seen:
                seen.add(id(t))
                yield module_name, name, t


def _real_tensors(stage: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every tensor not on the meta device, to put back after `to_empty`: buffers as they are,
    parameters as a copy of this rank's shard (FSDP2 gives the module new ones)."""
    kept = []
    for module in stage.modules():
        for name, t in _own_named(module):
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
        for name, _ in _own_named(module)
        if (id(module), name) not in kept_ids
    }
