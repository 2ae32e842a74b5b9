"""Consolidated export: the whole trained model (and optimizer) as plain state, written by rank 0.

Distributed checkpoints (`core.weights.checkpoint`) stay sharded, for resuming. An export is for the world
outside: every stage's every shard gathered to global rank 0 as plain CPU tensors keyed by the
model's original parameter names, then handed to a writer (the HF adapter writes `config.json` +
`model.safetensors`; the Lightning front writes one ordinary checkpoint file). Everything here is
collective: every rank calls it, with the same arguments.

Gathering streams one tensor at a time: within a pipeline stage, the data-parallel ranks all-gather
each sharded tensor and only the stage's first data-parallel rank keeps a CPU copy, so no device
ever holds more than one full tensor at once. The stages' leaders then send their CPU tensors to
global rank 0 (the first stage's leader: ranks are laid out pp-major).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from lightning_zeropp.core.mesh import ParallelDims
from lightning_zeropp.core.split.tied import local_ties
from lightning_zeropp.core.weights import commit
from lightning_zeropp.core.weights.name_order import tree_order

__all__ = ["full_optimizer_state_dict", "full_state_dict", "save_consolidated", "save_file"]


def full_state_dict(module: nn.Module, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """Collective: the whole model's state on global rank 0 (an empty dict on other ranks).

    `module` is this rank's stages (the engine's `module`, or a module holding them, such as the
    LightningModule whose network they replaced: its keys then carry the attribute prefix, and
    its other, unsplit state is taken from rank 0); `dims` the mesh it was sharded over. Values
    are contiguous CPU tensors keyed and ordered as the unsplit model's `state_dict()`; as
    there, the names of one tied weight share one tensor (its per-stage copies are checked
    equal), and other tensors share no storage.
    """
    # Sharded view (DTensors, original names): FSDP2-aware, as in core.checkpoint.
    sharded: dict[str, Any] = get_model_state_dict(
        module, options=StateDictOptions(full_state_dict=False)
    )
    leader = _is_leader(dims)
    # Every data-parallel rank of the stage walks the same names in the same order, so the
    # all-gathers inside full_tensor() line up. Names of one tensor (a tie inside a stage) are
    # gathered once.
    first_of = _first_names(module, sharded)
    local: dict[str, torch.Tensor | None] = {}
    groups: dict[str, list[str]] = {}
    for name, value in sharded.items():
        first = first_of[name]
        groups.setdefault(first, []).append(name)
        local[name] = _full_cpu(value, leader) if first == name else local[first]
    ties = [tuple(names) for names in groups.values() if len(names) > 1]
    ties += list(local_ties(module).values())
    parts = _gather_to_rank0((local, ties), dims)
    merged: dict[str, torch.Tensor] = {}
    problem = None
    for part, _ in parts or ():
        for name, tensor in part.items():
            # Constant buffers may be copied on several stages: the first copy is the copy.
            merged.setdefault(name, tensor)
    if parts is not None:
        problem = _alias_ties(merged, [group for _, groups in parts for group in groups])
    _raise_everywhere(problem)  # found on rank 0; every rank stops
    if parts is None:
        return {}
    return {name: merged[name] for name in tree_order([list(state) for state, _ in parts])}


def _first_names(module: nn.Module, state: dict[str, Any]) -> dict[str, str]:
    """{name in `state`: the first name of its tensor}: names of one parameter or buffer of
    `module` (a tie inside a stage) share their first name; other names are their own.

    Read from the module's objects, which every data-parallel rank of the stage holds alike: the
    local shards' storage would not do, since FSDP2's empty shards (a dimension 0 smaller than
    the data-parallel size, e.g. Qwen2-MoE's (1, hidden) `shared_expert_gate`) all sit at
    address 0 on the ranks past the end, which then took every such weight of one shape for one
    tensor and gathered it once while the rank holding it gathered each: the all-gathers no
    longer lined up (gloo: "64 vs 32" bytes).
    """
    tensors: list[tuple[str, torch.Tensor]] = [*module.named_parameters(remove_duplicate=False)]
    tensors += module.named_buffers(remove_duplicate=False)
    identity: dict[str, int] = {name: id(t) for name, t in tensors}
    first_by: dict[Any, str] = {}
    return {name: first_by.setdefault(identity.get(name, name), name) for name in state}


def _alias_ties(merged: dict[str, torch.Tensor], ties: list[tuple[str, ...]]) -> str | None:
    """Every name of a tie holds its first name's tensor, as in the unsplit model's state dict;
    per-stage copies that differ are a bug this refuses to export (the problem, or None)."""
    for names in ties:
        present = [n for n in names if n in merged]
        if not present:
            continue
        first = merged[present[0]]
        for other in present[1:]:
            if merged[other] is not first and not torch.equal(merged[other], first):
                gap = float((merged[other].float() - first.float()).abs().max())
                return (
                    f"the pipeline's copies of the tied weight {present[0]!r} and {other!r} "
                    f"differ (by up to {gap:.3g}); they are kept equal every step, so this is a "
                    "bug in lightning_zeropp: please report it."
                )
            merged[other] = first
    return None


def _raise_everywhere(problem: str | None) -> None:
    """Raise rank 0's `problem` on every rank (a lone raise would leave the others running)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem is not None:
        raise RuntimeError(problem)


def full_optimizer_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer, dims: ParallelDims
) -> dict[str, Any]:
    """Collective: `optimizer`'s state as the one-process `optimizer.state_dict()`, on rank 0.

    Every rank's optimizer holds its own stages' (sharded) parameters, in the same param groups
    (every rank ran the same `configure_optimizers`). The result numbers the parameters of each
    group in the unsplit model's order, group after group, as an optimizer built over the unsplit
    `module.parameters()` would; each group also lists its `param_names` (torch's format for
    named parameters), so a loader need not rely on that numbering. An empty dict elsewhere.
    """
    names = {param: name for name, param in module.named_parameters()}
    leader = _is_leader(dims)
    ties = list(local_ties(module).values())
    groups = []
    for group in optimizer.param_groups:
        state = {}
        for param in group["params"]:
            # Same walk on every data-parallel rank of the stage: the all-gathers line up.
            values = optimizer.state.get(param, {})
            state[names[param]] = {
                k: _full_cpu(v, leader) if torch.is_tensor(v) else v for k, v in values.items()
            }
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        groups.append({"hyper": hyper, "state": state})
    parts = _gather_to_rank0({"groups": groups, "order": list(names.values()), "ties": ties}, dims)
    if parts is None:
        return {}
    # A tied weight is one parameter to one process's optimizer: its first name's copy stands for
    # the others (their states are equal: the same gradients, the same steps).
    held = {name for part in parts for group in part["groups"] for name in group["state"]}
    doubles = {
        other
        for part in parts
        for tie in part["ties"]
        for other in tie[1:]
        if any(n in held for n in tie[: tie.index(other)])
    }
    rank = {name: i for i, name in enumerate(tree_order([part["order"] for part in parts]))}
    assert len({len(part["groups"]) for part in parts}) == 1, "param groups differ across ranks"
    out: dict[str, Any] = {"state": {}, "param_groups": []}
    for index in range(len(parts[0]["groups"])):
        members = [part["groups"][index] for part in parts]
        state = {
            name: s
            for member in members
            for name, s in member["state"].items()
            if name not in doubles
        }
        # A stage whose parameters all sit in other groups still has this group: take the
        # hyperparameters from a stage that has parameters in it.
        hyper = next((m["hyper"] for m in members if m["state"]), members[0]["hyper"])
        ordered = sorted(state, key=rank.__getitem__)
        first = sum(len(g["params"]) for g in out["param_groups"])
        ids = list(range(first, first + len(ordered)))
        out["state"].update(
            {i: state[name] for i, name in zip(ids, ordered, strict=True) if state[name]}
        )
        out["param_groups"].append({**hyper, "params": ids, "param_names": ordered})
    return out


def save_consolidated(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Collective: global rank 0 runs `write(tmp_dir)`, then renames `tmp_dir` to `path`.

    `path` is always either absent, the previous export, or the complete new one. When rank 0
    fails, every rank raises (no rank is left waiting at a barrier). Without a process group
    (one process) it just writes.
    """
    path = Path(path)

    def run(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        write(tmp)

    return _on_rank0(path, run)


def save_file(path: str | Path, obj: Any) -> Path:
    """Collective: global rank 0 `torch.save`s `obj` to `path`, atomically (temp file + rename).

    As `save_consolidated`: `path` is never half written, and a failure raises on every rank.
    """
    return _on_rank0(Path(path), lambda tmp: torch.save(obj, tmp))


def _on_rank0(path: Path, write: Callable[[Path], None]) -> Path:
    """Rank 0 writes to a temporary sibling of `path` and renames it into place; every rank
    returns after that, or raises rank 0's error."""
    distributed = dist.is_available() and dist.is_initialized()
    error: str | None = None
    original: BaseException | None = None
    if not distributed or dist.get_rank() == 0:
        tmp = commit.temporary(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write(tmp)
            commit.publish(tmp, path, link=False)  # an export stays a plain directory
        except Exception as err:  # reported to every rank below, then re-raised here
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
            error, original = f"{type(err).__name__}: {err}", err
    # Doubles as the barrier: nobody returns before rank 0 has renamed the export into place.
    box = [error]
    if distributed:
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise RuntimeError(f"exporting to {path} failed on rank 0: {box[0]}") from original
    return path


def _is_leader(dims: ParallelDims) -> bool:
    """The first data-parallel (and CP) rank of its stage (the one that keeps gathered
    copies): under context parallelism the stage's weights are sharded over the CP ranks too."""
    axes = ("dp_replicate", "dp_shard") + (("cp",) if dims.config.cp_size > 1 else ())
    return all(dims.mesh.get_local_rank(axis) == 0 for axis in axes)


def _full_cpu(value: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """The whole tensor (all-gathered if sharded) as a CPU copy where `keep`, else None."""
    full = value.full_tensor() if isinstance(value, DTensor) else value
    return full.detach().to("cpu", copy=True).contiguous() if keep else None


def _gather_to_rank0(local: Any, dims: ParallelDims) -> list[Any] | None:
    """Every stage leader's `local`, in pipeline-rank order, on global rank 0; None elsewhere."""
    if not _is_leader(dims):
        return None
    if dims.config.pp_size == 1:
        return [local]  # the only leader is global rank 0
    # Only the stage leaders (one pipeline group, which holds global rank 0) take part.
    gathered: list[Any] | None = [None] * dims.config.pp_size if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, group=dims.pp_group, group_dst=0)
    return gathered
