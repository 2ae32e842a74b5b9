"""The model's own init, run module by module on whole copies of each module's tensors, every rank
keeping its rows (`init_stage`: what `materialize` runs on a meta model's shards), and its
one-process reference (`init_weights`).

- the init is `init(module)` per module (HF's `_init_weights` shape), by default the model's own
  `_init_weights` (HF models) or each module's `reset_parameters()` (torch layers: `default_init`);
- each module's random stream is seeded by its name and one seed (rank 0's `initial_seed()`:
  `shared_seed`), so the values do not depend on the layout;
- an init that writes into a submodule's sharded tensors (it would reach shards, not whole
  tensors) is refused, and a tensor nothing set (still NaN) is named (`check_set`).
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_zeropp.core._torch_private import local_chunk, tensor_version
from lightning_zeropp.core.shard.fsdp import local_shard

__all__ = [
    "InitFn",
    "check_set",
    "default_init",
    "init_stage",
    "init_weights",
    "named_tensors",
    "own_named",
    "shared_seed",
]

InitFn = Callable[[nn.Module], None]


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


def check_set(stages: Sequence[nn.Module]) -> None:
    """Raise naming the first tensor nothing set (still NaN after materialize's fill)."""
    for stage in stages:
        for module_name, name, t in named_tensors(stage):
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


def init_stage(
    stage: nn.Module,
    init: InitFn,
    seed: int,
    only: Callable[[nn.Module, str, torch.Tensor], bool] | None,
    born: set[tuple[str, str]],
) -> None:
    """Initialize each module's own meta-born tensors at full size, keep this rank's rows."""
    # Only meta-born tensors are watched: an init may rightly reset a kept buffer of its own.
    watched = [(m, n, t) for m, n, t in named_tensors(stage) if (m, n) in born]
    versions = {id(t): tensor_version(local_shard(t)) for _, _, t in watched}
    written: dict[int, int] = {}
    done: set[int] = set()
    for module_name, module in stage.named_modules():
        own = [
            (name, t)
            for name, t in own_named(module)
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


def own_named(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    params = [(n, p) for n, p in module._parameters.items() if p is not None]
    return params + [(n, b) for n, b in module._buffers.items() if b is not None]


def named_tensors(stage: nn.Module) -> Iterable[tuple[str, str, torch.Tensor]]:
    """(module name, tensor name, tensor) of every distinct tensor of `stage`."""
    seen: set[int] = set()
    for module_name, module in stage.named_modules():
        for name, t in own_named(module):
            if id(t) not in seen:
                seen.add(id(t))
                yield module_name, name, t
