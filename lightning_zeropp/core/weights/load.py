"""Load a model's weights into this rank's shards, reading only what this rank holds.

Two sources, one call (`load_weights`):

- a distributed checkpoint (this library's, of any layout, or any DCP directory keyed by the
  model's names): DCP reads the byte ranges of this rank's shards only;
- an HF-style safetensors directory (`model.safetensors`, or shards listed in
  `model.safetensors.index.json`) or one `.safetensors` file: each file is memory-mapped and
  only this rank's rows of this rank's tensors are read, cast to the parameters' dtype.

Tied weights whose copy a file stores once (HF drops `lm_head.weight` when it is the embedding)
load from the name it has. Every name the rank holds must be in the source, with its shape;
otherwise every rank raises, naming the tensors. A buffer the file lacks keeps the value it was
built with (a meta-built one must then come from the init; `init_modules.check_set` says so).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from lightning_zeropp.core._torch_private import local_chunk
from lightning_zeropp.core.shard.fsdp import local_shard
from lightning_zeropp.core.weights.collective import all_gather, raise_on_every_rank
from lightning_zeropp.core.weights.trust import SafeLoadPlanner, content_problem

__all__ = ["load_weights", "weight_source_kind"]

_INDEX = "model.safetensors.index.json"


def weight_source_kind(path: str | Path) -> str:
    """ "dcp" or "safetensors"; raises naming what a source must look like."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return "dcp"
    if path.suffix == ".safetensors" and path.is_file():
        return "safetensors"
    if path.is_dir() and ((path / _INDEX).is_file() or any(path.glob("*.safetensors"))):
        return "safetensors"
    raise FileNotFoundError(
        f"load_from={str(path)!r} is neither a distributed checkpoint (a directory with "
        "'.metadata') nor safetensors weights (a .safetensors file, or a directory holding "
        f"model.safetensors or {_INDEX})."
    )


@torch.no_grad()
def load_weights(
    module: nn.Module,
    path: str | Path,
    tied: Sequence[tuple[str, ...]] = (),
    base_prefix: str = "",
) -> None:
    """Collective: fill this rank's parameters and persistent buffers of `module` (named as
    in the unsplit model) from `path`. `tied`: groups of names that are one weight;
    `base_prefix`: HF's `base_model_prefix`, which a file saved from the base model lacks."""
    if weight_source_kind(path) == "dcp":
        _load_dcp(module, Path(path))
    else:
        _load_safetensors(module, Path(path), tied, base_prefix)


def _load_dcp(module: nn.Module, path: Path) -> None:
    options = StateDictOptions(strict=True)
    state = get_model_state_dict(module, options=options)
    # Checksums and `.metadata`'s globals first: nothing is unpickled before (`weights.trust`).
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    raise_on_every_rank(content_problem(path, rank, world))
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = _saved_prefix(list(state), saved)
    missing = [n for n in state if prefix + n not in saved]
    known = {prefix + n for names in all_gather(list(state)) for n in names}
    extra = [k for k in saved if k not in known and k.startswith(prefix)]
    problem = None
    if missing:
        problem = (
            f"the checkpoint {path} lacks {len(missing)} of this model's tensors (e.g. "
            f"{missing[:3]}): it was saved from another model."
        )
    elif extra:
        problem = (
            f"the checkpoint {path} holds {len(extra)} tensors this model lacks (e.g. "
            f"{extra[:3]}): it was saved from another model (a deeper or wider one)."
        )
    raise_on_every_rank(problem)
    try:
        dcp.load(
            {prefix + n: value for n, value in state.items()},
            checkpoint_id=str(path),
            planner=SafeLoadPlanner(),
        )
    except CheckpointException as err:
        rank, (cause, _) = next(iter(err.failures.items()))
        raise RuntimeError(
            f"loading weights from {path} failed on rank {rank}: {type(cause).__name__}: {cause}"
        ) from err
    set_model_state_dict(module, state, options=options)


def _saved_prefix(names: list[str], saved: Any) -> str:
    """The prefix the checkpoint keeps this model's names under, the one that finds the most:
    none (a plain DCP directory), "model." (this library's checkpoints), or "model.<attr>." (a
    Lightning checkpoint of a LightningModule holding this network as `self.<attr>`). An HF
    model's own names start with "model." too, hence the count."""
    candidates = ["", "model."]
    if names:
        first = names[0]
        candidates += sorted(
            {k[: -len(first)] for k in saved if k.endswith(f".{first}") and k.startswith("model.")}
        )
    return max(candidates, key=lambda prefix: sum(prefix + n in saved for n in names))


def _load_safetensors(
    module: nn.Module, path: Path, tied: Sequence[tuple[str, ...]], prefix: str
) -> None:
    from safetensors import safe_open

    where = _weight_map(path)
    targets, shared = _targets(module)
    # Names of one weight: tied across stages (`tied`), or one tensor under two names here.
    aliases = {name: group for group in [*tied, *shared] for name in group}
    found: dict[str, tuple[str, str]] = {}  # our name -> (file, its name there)
    missing: list[str] = []
    for name in targets:
        candidates = [name, *aliases.get(name, ())]
        if prefix and name.startswith(prefix + "."):  # saved from the base model
            candidates.append(name[len(prefix) + 1 :])
        key = next((c for c in candidates if c in where), None)
        if key is None and isinstance(targets[name], nn.Parameter):
            missing.append(name)
        elif key is None:  # a buffer HF files leave out: its built value stays (or is NaN-checked)
            continue
        else:
            found[name] = (where[key], key)
    problem = None
    if missing:
        problem = (
            f"the safetensors weights at {path} lack {len(missing)} of this model's tensors "
            f"(e.g. {missing[:3]}): they were saved from another model, or under other names."
        )
    by_file: dict[str, list[str]] = {}
    for name, (file, _) in found.items():
        by_file.setdefault(file, []).append(name)
    shapes: list[str] = []
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as handle:
            for name in names:
                tensor, key = targets[name], found[name][1]
                view = handle.get_slice(key)
                if tuple(view.get_shape()) != tuple(tensor.shape):
                    shapes.append(f"{name}: {tuple(view.get_shape())} vs {tuple(tensor.shape)}")
                    continue
                local = local_shard(tensor)
                if tensor.dim() == 0:
                    local.copy_(handle.get_tensor(key))
                elif local.numel():
                    local.copy_(view[local_chunk(tensor)])
    if shapes and problem is None:
        problem = (
            f"the safetensors weights at {path} are of another model size: {shapes[:3]} "
            "(saved vs this model)."
        )
    raise_on_every_rank(problem)


def _targets(module: nn.Module) -> tuple[dict[str, torch.Tensor], list[tuple[str, ...]]]:
    """What a checkpoint holds (parameters and persistent buffers, by full name, each tensor
    once), and the names of tensors held under several names."""
    out: dict[str, torch.Tensor] = {}
    names: dict[int, list[str]] = {}
    for module_name, sub in module.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        own = [(n, p) for n, p in sub._parameters.items() if p is not None]
        own += [
            (n, b)
            for n, b in sub._buffers.items()
            if b is not None and n not in sub._non_persistent_buffers_set
        ]
        for name, t in own:
            full = prefix + name
            if full in names.get(id(t), []):
                continue
            names.setdefault(id(t), []).append(full)
            if len(names[id(t)]) == 1:
                out[full] = t
    return out, [tuple(n) for n in names.values() if len(n) > 1]


def _weight_map(path: Path) -> dict[str, str]:
    """Tensor name -> file holding it."""
    if path.is_file():
        return dict.fromkeys(_keys(path), str(path))
    index = path / _INDEX
    if index.is_file():
        weight_map: dict[str, Any] = json.loads(index.read_text())["weight_map"]
        return {k: str(path / v) for k, v in weight_map.items()}
    out: dict[str, str] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(dict.fromkeys(_keys(file), str(file)))
    return out


def _keys(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        return list(handle.keys())
