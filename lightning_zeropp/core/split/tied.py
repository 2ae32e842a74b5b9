"""Tied weights across pipeline stages: a copy per stage, gradients summed (Megatron's embedding group).

A model may use one tensor under several names: with HF's `tie_word_embeddings`, `lm_head.weight`
is `model.embed_tokens.weight`. split="call" (and "stack") builds every stage from a deep copy of
the modules it runs, so a weight whose names land on different stages becomes one copy per stage
that holds one of them (the embedding's on the first stage, the head's on the last), all equal at
the start. One process gives the shared weight the sum of the gradients of all its uses; each
copy only sees its own stage's uses. `TiedWeights.sum_grads` puts the sum back after each step's
backward: a rank holding several copies adds theirs, then the ranks holding a copy all-reduce.
Every copy then has the one-process gradient, the same optimizer takes the same step from the
same state, and the copies stay equal, as Megatron keeps its first- and last-stage word
embeddings equal with its embedding group. Their names stay the model's, so checkpoints and
exports hold every name, with equal values.

FSDP2 shards every copy alike (one shape, dim 0 over the same data-parallel mesh), so at one dp
coordinate each copy's local shard is the same slice of the weight: the all-reduce runs per dp
coordinate, over the pipeline ranks of that coordinate that hold a copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_zeropp.core.mesh import ParallelDims, world_timeout
from lightning_zeropp.core.shard.fsdp import local_shard

__all__ = ["TiedWeights", "local_ties", "tied_groups"]

# Set on every per-stage copy of a tied weight: the tie's names in the unsplit model. Whatever
# walks a rank's stages later (exports, checkpoints, under any prefix) finds the ties there.
_TIE_ATTR = "_zeropp_tied_names"


def tied_groups(model: nn.Module, frozen: bool = False) -> list[tuple[str, ...]]:
    """Names that are one trainable tensor, in the model's order; only groups of two or more.

    Frozen tied weights are left out unless `frozen`: they get no gradient, so their copies stay
    equal as they are (a model re-tied or exported after training wants them all).
    """
    names: dict[int, list[str]] = {}
    trainable: dict[int, bool] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        trainable[id(param)] = param.requires_grad
    return [tuple(n) for key, n in names.items() if len(n) > 1 and (frozen or trainable[key])]


@dataclass
class _Tie:
    """One tied weight as this rank sees it."""

    names: tuple[str, ...]
    copies: list[nn.Parameter] = field(default_factory=list)  # distinct tensors, in stage order
    # The ranks holding a copy at this rank's dp coordinate, when there are several (else None).
    group: dist.ProcessGroup | None = None
    source: nn.Parameter | None = None  # the copy on the lowest stage, when this rank holds it


class TiedWeights:
    """Keeps the per-stage copies of each tied weight equal by summing their gradients.

    Collective to build: every rank of the world constructs it, with the same `groups` (from
    `tied_groups` of the unsplit model), after its stages are sharded. `stages` are this rank's
    `(stage index, stage module)` pairs.
    """

    def __init__(
        self,
        groups: Sequence[tuple[str, ...]],
        stages: Sequence[tuple[int, nn.Module]],
        dims: ParallelDims,
    ) -> None:
        self._ties: list[_Tie] = []
        # ids of the copies a global gradient norm must not count again (each holds the same
        # gradient as the copy on the lowest stage, which is counted).
        self._duplicates: set[int] = set()
        if not groups:  # the common case: no collective at all
            return
        local = [_local_copies(names, stages) for names in groups]
        held = _gather([[stage for stage, _ in copies] for copies in local], dims)
        subgroups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for index, (names, copies) in enumerate(zip(groups, local, strict=True)):
            stages_of = [rank_stages[index] for rank_stages in held]  # per pipeline rank
            holders = tuple(rank for rank, found in enumerate(stages_of) if found)
            assert holders, f"no stage holds the tied parameters {list(names)}"
            if len(holders) > 1 and holders not in subgroups:
                # Same order on every rank: every pipeline holds the same stages, so every rank
                # gathered the same `held`.
                subgroups[holders] = _holder_group(holders, dims)
            first = min(stage for found in stages_of for stage in found)
            source = next((p for stage, p in copies if stage == first), None)
            tie = _Tie(names, [p for _, p in copies], subgroups.get(holders), source)
            _check_alike(tie)
            for p in tie.copies:
                setattr(p, _TIE_ATTR, tuple(names))
            self._duplicates.update(id(p) for stage, p in copies if stage != first)
            self._ties.append(tie)

    def names(self) -> list[tuple[str, ...]]:
        """Every tied group's names (the same on every rank)."""
        return [tie.names for tie in self._ties]

    def counted(self, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """`params` without the duplicate copies: what a global gradient norm sums over."""
        return [p for p in params if id(p) not in self._duplicates]

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Give every copy the sum of all copies' gradients (this step's only: call it before
        earlier accumulation steps' gradients are added back). Collective over the ranks holding
        copies; other ranks return at once."""
        for tie in self._ties:  # the same order on every rank: collectives line up
            if not tie.copies:
                continue
            grads = [local_shard(p.grad) for p in tie.copies if p.grad is not None]
            if len(grads) == 1 and len(tie.copies) == 1:
                total = grads[0]  # reduced in place: nothing to add, nothing to copy back
            elif grads:
                total = torch.stack(grads).sum(0)
            else:  # no use on this rank this step: it still joins the sum, with zeros
                total = torch.zeros_like(local_shard(tie.copies[0]))
            if tie.group is not None:
                dist.all_reduce(total, group=tie.group)
            for p in tie.copies:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                local = local_shard(p.grad)
                if local is not total:
                    local.copy_(total)

    @torch.no_grad()
    def sync_values(self) -> None:
        """Give every copy the values of the copy on the lowest stage (after each stage has
        initialized its own copy on the meta path). Collective like `sum_grads`."""
        for tie in self._ties:
            if not tie.copies:
                continue
            if tie.source is not None:
                value = local_shard(tie.source).clone()
            else:
                value = torch.zeros_like(local_shard(tie.copies[0]))
            if tie.group is not None:  # one holder adds its values, the others zeros: exact
                dist.all_reduce(value, group=tie.group)
            for p in tie.copies:
                local_shard(p).copy_(value)


def local_ties(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """{name in `module`: the names of its tie} for every per-stage copy of a tied weight that
    `module` holds (this rank's stages, or a module holding them under a prefix: the tie's names
    get the same prefix), the tie's names in the model's order."""
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names = getattr(p, _TIE_ATTR, None)
        if names is not None:
            own = next(n for n in names if name == n or name.endswith(f".{n}"))
            prefix = name[: len(name) - len(own)]
            out[name] = tuple(prefix + n for n in names)
    return out


def _local_copies(
    names: tuple[str, ...], stages: Sequence[tuple[int, nn.Module]]
) -> list[tuple[int, nn.Parameter]]:
    """(stage index, parameter) of each distinct copy on this rank. A stage holding several of
    the names holds them as one tensor (the deep copy kept the tie inside the stage)."""
    found: list[tuple[int, nn.Parameter]] = []
    for stage, module in stages:
        params = dict(module.named_parameters(remove_duplicate=False))
        for name in names:
            p = params.get(name)
            if p is not None and all(p is not q for _, q in found):
                found.append((stage, p))
    return found


def _gather(held: list[list[int]], dims: ParallelDims) -> list[list[list[int]]]:
    """Every pipeline rank's `held` (per tie: the stages holding a copy), by pipeline rank."""
    pp_size = dims.config.pp_size
    if pp_size == 1:
        return [held]
    out: list[list[list[int]] | None] = [None] * pp_size
    dist.all_gather_object(out, held, group=dims.pp_group)
    return [x for x in out if x is not None]


def _holder_group(holders: tuple[int, ...], dims: ParallelDims) -> dist.ProcessGroup | None:
    """The group of the pipeline ranks `holders` at this rank's dp coordinate.

    All pipeline ranks: the mesh's pp group. Otherwise one new group per dp coordinate; every
    rank of the world creates all of them (torch requires it), in dp-coordinate order. Like the
    mesh's, they get the world group's timeout.
    """
    pp_size = dims.config.pp_size
    if len(holders) == pp_size:
        return dims.pp_group
    ranks = dims.mesh.mesh.reshape(pp_size, -1)  # (pp, dp coordinate) -> global rank
    per_dp = [[int(ranks[h, dp]) for h in holders] for dp in range(ranks.shape[1])]
    mine, _ = dist.new_subgroups_by_enumeration(per_dp, timeout=world_timeout())
    return mine


def _check_alike(tie: _Tie) -> None:
    """Copies on one rank must be sharded alike, or their local shards are different slices."""
    if not tie.copies:
        return
    ref = tie.copies[0]
    for p in tie.copies[1:]:
        same = p.shape == ref.shape and type(p) is type(ref)
        if same and isinstance(p, DTensor) and isinstance(ref, DTensor):  # `same`: one type
            same = p.placements == ref.placements and p.device_mesh == ref.device_mesh
        assert same, f"copies of the tied parameters {list(tie.names)} are sharded differently"
