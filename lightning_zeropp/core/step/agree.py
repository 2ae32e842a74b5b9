"""What every rank must agree on, checked before it is acted on: settings and replicas' weights.

Each rank resolves its settings from its own arguments and environment, so a `ZEROPP_*`
variable set differently on one node gives that node another layout: blocks missing from every
stage, or collectives that never match. `agree(fields)` compares named values across the world
with one all-reduce of their hash (a 64-bit hash, its maximum and minimum). When they differ every
rank raises a `ValueError` naming the first field that differs, its value on two ranks, and
its `ZEROPP_*` variable on each (read from the store, where each rank then writes its values).
`settings_fields(config)` names every field of a settings dataclass generically: a new setting is
compared without an edit here.

Data-parallel replicas (HSDP's `dp_replicate`) must start from the same weights: models built
without a shared seed differ, and their replicas then train apart while averaging gradients.
`check_replicas` compares an exact checksum of every parameter shard over each replica group (two
small all-reduces) and raises on every rank naming the first parameter that differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_zeropp.core._torch_private import default_store
from lightning_zeropp.core.mesh import world_timeout
from lightning_zeropp.core.step.failure import raised_everywhere
from lightning_zeropp.core.step.store import BoundedStore, store_deadline_s

__all__ = ["agree", "check_replicas", "model_layout", "settings_fields"]

_KEY = "lightning_zeropp/agree"
_ENV_PREFIX = "ZEROPP_"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_CALLS = itertools.count()  # every rank calls agree in the same order: the keys match
# fields that come from a ZEROPP_* variable (`settings_fields` adds the settings' own)
_VARIABLES = {"split", "check_batch"}


def settings_fields(settings: Any, **extra: Any) -> dict[str, str]:
    """`settings`' dataclass fields (and `extra` values), each as a comparable string. A field
    of `settings` comes from its `ZEROPP_<FIELD>` variable when not given in code; of the
    extras `split` and `check_batch` have one (`ZEROPP_SPLIT`, `ZEROPP_CHECK_BATCH`)."""
    fields = {f.name: _text(getattr(settings, f.name)) for f in dataclasses.fields(settings)}
    _VARIABLES.update(f.name for f in dataclasses.fields(settings))
    return fields | {k: _text(v) for k, v in extra.items()}


def agree(fields: dict[str, str], what: str = "settings") -> None:
    """Collective over the world: raise `ValueError` on every rank if any rank's `fields`
    differ from another's (the same names on every rank). Cheap when they agree: one all-reduce
    of two integers."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    call = next(_CALLS)
    text = json.dumps(fields, sort_keys=True)
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
    bounds = torch.tensor([digest, -digest], dtype=torch.int64)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)  # under the caller's failure guard
    if int(bounds[0]) == -int(bounds[1]):  # the largest hash is the smallest: all equal
        return
    raise raised_everywhere(ValueError(_difference(fields, digest, f"{_KEY}/{call}", what)))


def _difference(fields: dict[str, str], digest: int, key: str, what: str) -> str:
    """The same message on every rank: the first field in which rank 0 and the first rank
    unlike it differ, with each one's `ZEROPP_*` variable."""
    rank, world = dist.get_rank(), dist.get_world_size()
    store = BoundedStore(default_store(), store_deadline_s(world_timeout()))
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIX)}
    store.set(f"{key}/{rank}", json.dumps({"digest": digest, "fields": fields, "env": env}))
    first = json.loads(store.get(f"{key}/0"))
    other = next(
        (
            (r, seen)
            for r in range(1, world)
            if (seen := json.loads(store.get(f"{key}/{r}")))["digest"] != first["digest"]
        ),
        None,
    )
    assert other is not None, "the hashes differ, so some rank differs from rank 0"
    r, seen = other
    names = list(first["fields"]) + [n for n in seen["fields"] if n not in first["fields"]]
    name = next(n for n in names if first["fields"].get(n) != seen["fields"].get(n))
    values = f"{first['fields'].get(name)} on rank 0 and {seen['fields'].get(name)} on rank {r}"
    if name not in _VARIABLES:
        return (
            f"the ranks disagree on their {what}: {name} is {values}. Every rank must build the "
            "same model (the same blocks, the same parameter shapes) with the same settings."
        )
    var = _ENV_PREFIX + name.upper()
    sources = ", ".join(
        f"{var}={env_of[var]!r} on rank {who}" if var in env_of else f"{var} unset on rank {who}"
        for who, env_of in ((0, first["env"]), (r, seen["env"]))
    )
    return (
        f"the ranks disagree on their {what}: {name} is {values} ({sources}). Every rank must "
        f"run with the same {what}: set {var} alike on every rank (or unset it and pass the "
        "value in code), and build the same model everywhere."
    )


def model_layout(model: nn.Module, plan: Any) -> dict[str, Any]:
    """What the ranks' models must share: each stage's blocks (`plan`, a `BlockPlan` or None)
    and every parameter's name, shape and dtype (a digest)."""
    shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]
    stages = [list(r) for r in plan.ranges] if plan is not None else None
    return {"stage_blocks": stages, "model_parameters": f"{len(shapes)} tensors, {digest}"}


@torch.no_grad()
def check_replicas(
    named: Iterable[tuple[str, torch.Tensor]], replica_group: dist.ProcessGroup | None
) -> None:
    """Collective over the world: raise `ValueError` on every rank if the replicas of
    `replica_group` (this rank's dp_replicate group; None: no replicas) hold different values
    of any parameter shard."""
    if replica_group is None or dist.get_world_size(replica_group) == 1:
        return
    names, sums = [], []
    for name, param in named:
        names.append(name)
        sums.append(_checksum(param.to_local() if hasattr(param, "to_local") else param))
    high = torch.tensor(sums, dtype=torch.int64).reshape(-1, 2)
    low = high.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=replica_group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=replica_group)
    differ = (high != low).any(dim=1).nonzero().flatten().tolist()
    mine = [f"'{names[differ[0]]}' (rank {dist.get_rank()})"] if differ else []
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    found = [name for names_of in everyone for name in names_of]
    if found:
        raise raised_everywhere(
            ValueError(
                f"the data-parallel replicas (dp_replicate) start from different weights: {found[0]} "
                f"differs between replicas{' (and more)' if len(found) > 1 else ''}, so they would "
                "train apart while averaging gradients. Build the model from the same seed on "
                "every rank (torch.manual_seed(0) or lightning.seed_everything(0) before building "
                "it), or load its weights (load_from=...)."
            )
        )


def _checksum(tensor: torch.Tensor) -> tuple[int, int]:
    """An exact checksum of a tensor's bits: their sum and a position-weighted sum (int64,
    wrapping), equal on two tensors exactly when their values are, barring collisions."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return (0, 0)
    if flat.is_floating_point() or flat.is_complex():
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        flat = flat.view(ints[flat.element_size()])
    bits = flat.to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % 1021 + 1
    return int(bits.sum()), int((bits * weights).sum())


def _text(value: Any) -> str:
    """A value as every rank writes it alike: a function by its qualified name, and no object's
    address (a default repr names one, and it differs between processes)."""
    if isinstance(value, torch.dtype):
        return str(value)
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', None)}.{value.__qualname__}"
    return _ADDRESS.sub("", repr(value))
