"""Blocks: where a model's repeated layers live and which of them each pipeline stage gets.

Blocks are found by structure: of the `ModuleList` / `ModuleDict` / `nn.Sequential` containers
holding at least two modules of one class (a stack of repeated layers), the one whose repeated
layers hold the most parameters (ties: more children, then the shallower path). Not by child count:
torchvision's ViT MLP (`nn.Sequential` of Linear, GELU, Dropout, Linear, Dropout) has more children
than a 4-layer encoder but only part of one layer's parameters. Stages get contiguous runs of
blocks: at `split_points` (the block index each stage after the first starts at) when given, else
balanced by block parameter count here; the engine then re-cuts by cost (`core.split.cost`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = [
    "BlockPlan",
    "balanced_starts",
    "find_blocks",
    "num_params",
    "plan_blocks",
    "stage_param_names",
]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass(frozen=True)
class BlockPlan:
    """Where the blocks live and which blocks each stage gets."""

    container: str  # dotted path of the block container ("" when the model itself is one)
    names: list[str]  # child names of the blocks, in order
    ranges: list[range]  # per stage: indices into `names`
    # what the cut was chosen by, in words (the layout prints it), and the costs it balanced
    # (`core.split.cost.PieceCosts`; None when cut by parameters or given split points)
    basis: str = "parameters"
    costs: Any = None

    def fqn(self, block_index: int) -> str:
        name = self.names[block_index]
        return f"{self.container}.{name}" if self.container else name

    def stage_blocks(self, stage: int) -> list[str]:
        """Fully qualified names of the blocks of one stage."""
        return [self.fqn(i) for i in self.ranges[stage]]


def find_blocks(model: nn.Module) -> tuple[str, list[str]]:
    """Return (container path, child names) of the model's repeated blocks."""
    best: tuple[tuple[int, int, int], str] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, _CONTAINERS) or len(module) < 2:
            continue
        score = (_repeated_params(module), len(module), -path.count("."))
        if not score[0]:  # no class repeats with parameters: metrics, activations, a head
            continue
        if best is None or score > best[0]:
            best = (score, path)
    if best is None:
        raise ValueError(
            f"cannot split {type(model).__name__} into pipeline stages: it has no ModuleList, "
            "ModuleDict or nn.Sequential holding at least 2 layers of one class. Put its repeated "
            "layers in one, or pass split=<callable> that builds each stage."
        )
    container = model.get_submodule(best[1])
    return best[1], list(container._modules.keys())


def _repeated_params(container: nn.Module) -> int:
    """Parameters held by the container's most repeated layer class (0 when none repeats): a
    stack of layers is one class repeated; a container of distinct modules is not."""
    groups: dict[type, list[nn.Module]] = {}
    for child in container.children():
        groups.setdefault(type(child), []).append(child)
    best = 0
    for members in groups.values():
        held = sum(num_params(m) for m in members)
        if len(members) >= 2 and held:
            best = max(best, held)
    return best


def plan_blocks(
    model: nn.Module, num_stages: int, split_points: Sequence[int] | None = None
) -> BlockPlan:
    """Assign contiguous blocks to `num_stages` stages."""
    container, names = find_blocks(model)
    if len(names) < num_stages:
        raise ValueError(
            f"{type(model).__name__} has {len(names)} blocks in '{container or '<root>'}' but the "
            f"layout needs {num_stages} stages (pp_size x num_chunks); lower pp_size or "
            "num_chunks, or use a model with more blocks."
        )
    if split_points is not None:
        starts = _check_split_points(split_points, num_stages, len(names))
    else:
        holder = model.get_submodule(container) if container else model
        sizes = [num_params(holder.get_submodule(n)) for n in names]
        starts = balanced_starts(sizes, num_stages)
    bounds = [*starts, len(names)]
    ranges = [range(bounds[i], bounds[i + 1]) for i in range(num_stages)]
    return BlockPlan(container=container, names=names, ranges=ranges)


def _check_split_points(points: Sequence[int], num_stages: int, num_blocks: int) -> list[int]:
    starts = [0, *points]
    increasing = all(a < b for a, b in zip(starts, starts[1:], strict=False))
    if len(points) != num_stages - 1 or not increasing or starts[-1] >= num_blocks:
        raise ValueError(
            f"split_points={list(points)} must list {num_stages - 1} strictly increasing block "
            f"indices in 1..{num_blocks - 1} (where stages 1..{num_stages - 1} start)."
        )
    return starts


def balanced_starts(sizes: Sequence[float], num_stages: int) -> list[int]:
    """Contiguous partition of `sizes` minimising the largest part (exact, by dynamic programming)."""
    n = len(sizes)
    prefix: list[float] = [0.0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # cost[k][i]: best max-part for the first i blocks in k parts; cut[k][i]: start of the k-th part
    cost = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    cost[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                c = max(cost[k - 1][j], prefix[i] - prefix[j])
                if c < cost[k][i]:
                    cost[k][i], cut[k][i] = c, j
    starts, i = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def stage_param_names(stages: Sequence[nn.Module]) -> list[str]:
    """All parameter names of some stage modules (used to check that none is shared)."""
    return [n for s in stages for n, _ in s.named_parameters()]
