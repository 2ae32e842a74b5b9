"""Stages cut by cost: the split points that make the busiest pipeline rank least busy.

A micro-batch's work is priced piece by piece (the embedding before the blocks, each block, the
final norm, head and loss after them) from one run of the model on the meta device
(`core.split.profile`, the planner's own count): forward FLOPs, backward twice those, and a
recomputed block's forward once more. A pipeline runs at the pace of its busiest rank, and a rank
may hold several stages (a loop: rank r holds r, r + pp, ...; a V: rank r holds r and 2pp - 1 - r,
so the first and last stage, with the embedding and the head, share rank 0): the cut minimises the
largest per-rank total, then the next largest, and so on (a sorted tuple compared in order), then
the same of the stages, among cuts a `fits` check accepts (memory).

The engine cuts with `cost_cut` when no `split_points` are given and the planner prices the same
cut (`PieceCosts` from the same profile); a model the profile cannot run (inputs other than token
ids) keeps the parameter-count cut, and the layout says so.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_zeropp.core.settings.placement import Style, rank_of_stage
from lightning_zeropp.core.split.blocks import balanced_starts
from lightning_zeropp.core.split.profile import ModelProfile, profile_copy

__all__ = [
    "PieceCosts",
    "cost_cut",
    "guess_seq_len",
    "measure_costs",
    "meta_copy",
    "rank_loads",
    "stage_loads",
]

# Above this many possible cuts the search is local (moves of one block between two stages,
# shifting the stages between); below it every cut is priced.
_EXHAUSTIVE = 20_000
# A sequence length read from a model's config is capped here: a context of 128k tokens is rarely
# what one trains on, and attention's quadratic term would price the blocks for it.
SEQ_CAP = 4096
SEQ_DEFAULT = 2048


@dataclass(frozen=True)
class PieceCosts:
    """One micro-batch's forward + backward FLOPs per piece, and the bytes each saves."""

    before: float  # embeddings and whatever runs before the first block
    blocks: tuple[float, ...]
    after: float  # final norm, head and loss
    seq_len: int  # the sequence the figures are for

    @classmethod
    def of(cls, profile: ModelProfile, seq_len: int, recompute: bool = False) -> PieceCosts:
        """Backward costs twice the forward; a recomputed block runs its forward once more."""
        block = 4.0 if recompute else 3.0
        return cls(
            before=3.0 * profile.before.flops,
            blocks=tuple(block * p.flops for p in profile.blocks),
            after=3.0 * profile.after.flops,
            seq_len=seq_len,
        )

    def stage(self, blocks: range, num_stages: int, stage: int) -> float:
        cost = sum(self.blocks[i] for i in blocks)
        cost += self.before if stage == 0 else 0.0
        return cost + (self.after if stage == num_stages - 1 else 0.0)

    def head_in_blocks(self) -> float:
        """What the head and loss cost, in blocks (the mean block)."""
        return self.after / (sum(self.blocks) / len(self.blocks))


def stage_loads(costs: PieceCosts, starts: Sequence[int]) -> list[float]:
    """Each stage's forward + backward FLOPs for a cut (stage s starts at `starts[s]`)."""
    bounds = [*starts, len(costs.blocks)]
    n = len(starts)
    return [costs.stage(range(bounds[s], bounds[s + 1]), n, s) for s in range(n)]


def rank_loads(costs: PieceCosts, starts: Sequence[int], style: Style, pp_size: int) -> list[float]:
    """Each pipeline rank's forward + backward FLOPs for a cut (stage s starts at `starts[s]`)."""
    loads = [0.0] * pp_size
    for s, part in enumerate(stage_loads(costs, starts)):
        loads[rank_of_stage(style, s, pp_size)] += part
    return loads


def cost_cut(
    costs: PieceCosts,
    num_stages: int,
    style: Style,
    pp_size: int,
    start: Sequence[int],
    fits: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """The stage starts (block indices, the first 0) minimising the sorted per-rank loads.

    `start`: a cut to begin from and to keep on a tie (the parameter-count cut), and the answer
    when no cut `fits`."""
    n = len(costs.blocks)

    def key(starts: Sequence[int]) -> tuple[tuple[float, ...], tuple[float, ...]]:
        # ranks first; among cuts whose ranks tie, the stages too (a V's two stages of a rank
        # run at different times: one tiny and one huge stall the stages around them)
        ranks = sorted(rank_loads(costs, starts, style, pp_size), reverse=True)
        return tuple(ranks), tuple(sorted(stage_loads(costs, starts), reverse=True))

    ok = fits or (lambda starts: True)
    best = list(start)
    best_key = key(best) if ok(best) else None
    if math.comb(n - 1, num_stages - 1) <= _EXHAUSTIVE:
        candidates: Any = ([0, *c] for c in itertools.combinations(range(1, n), num_stages - 1))
    else:
        candidates = _local_search(
            key, ok, n, num_stages, [list(start), _by_cost(costs, num_stages)]
        )
    for cut in candidates:
        k = key(cut)
        if (best_key is None or k < best_key) and ok(cut):
            best, best_key = list(cut), k
    return best


def _by_cost(costs: PieceCosts, num_stages: int) -> list[int]:
    """The cut balancing each stage (not each rank): the exact answer for one stage per rank."""
    sizes = list(costs.blocks)
    sizes[0] += costs.before  # stage 0 always holds block 0; the last stage the last block
    sizes[-1] += costs.after
    return balanced_starts(sizes, num_stages)


def _local_search(
    key: Callable[[Sequence[int]], Any],
    ok: Callable[[list[int]], bool],
    n: int,
    num_stages: int,
    seeds: list[list[int]],
) -> list[list[int]]:
    """From each seed, take the best of the moves that shift stages i..j one block either way
    (one block moves from stage i's rank to stage j's, the stages between keep their sizes) while
    it improves; return where each seed ended."""
    ends = []
    for cut in seeds:
        current = key(cut) if ok(cut) else None
        while True:
            moves = []
            for i in range(1, num_stages):
                for j in range(i, num_stages):
                    for d in (-1, 1):
                        new = cut[:i] + [s + d for s in cut[i : j + 1]] + cut[j + 1 :]
                        valid = all(a < b for a, b in itertools.pairwise(new)) and new[-1] < n
                        if valid and new[1] >= 1:
                            moves.append((key(new), new))
            better = sorted(m for m in moves if current is None or m[0] < current)
            found = next((m for m in better if ok(m[1])), None)  # the best that fits
            if found is None:
                break
            current, cut = found
        ends.append(cut)
    return ends


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are empty meta tensors (nothing allocated,
    nothing read): what the profile runs."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(
            torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
        )
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def guess_seq_len(
    model: nn.Module, example_args: tuple[Any, ...] | None, example_kwargs: dict[str, Any] | None
) -> tuple[int, str]:
    """The tokens per row to price, and where the figure came from: the example micro-batch's
    token ids; else the model's context length (`config` / `cfg`: `max_position_embeddings`, `seq_len`,
    `block_size`, `n_positions`) capped at SEQ_CAP; else SEQ_DEFAULT."""
    values = [*(example_args or ()), *(example_kwargs or {}).values()]
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() == 2 and not v.is_floating_point():
            return int(v.shape[1]), "the example micro-batch"
    config = getattr(model, "config", None) or getattr(model, "cfg", None)  # HF, litgpt; ours
    for name in ("max_position_embeddings", "seq_len", "block_size", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return min(value, SEQ_CAP), f"the model's {name} (capped at {SEQ_CAP})"
    return SEQ_DEFAULT, f"assumed ({SEQ_DEFAULT}; no example batch or context length)"


def measure_costs(model: nn.Module, seq_len: int, recompute: bool) -> PieceCosts | str:
    """The model's piece costs at `seq_len` tokens (one row), or why they could not be measured
    (the profile feeds token ids; a model taking other inputs cannot run it)."""
    try:
        # a model drawing random numbers outside torch's meta kernels must not shift the
        # generator the run's own numbers come from
        with torch.random.fork_rng(devices=[]):
            profile = profile_copy(meta_copy(model), seq_len)
    except Exception as err:  # any model the profile cannot run keeps the parameter cut
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:160]
    costs = PieceCosts.of(profile, seq_len, recompute)
    if not all(c > 0 for c in costs.blocks):
        return "the profile counted no FLOPs in some block"
    return costs
