"""Where the planner cuts stages: the engine's cut by cost (`core.split.cost`, the same profile and
the same search), or the parameter-count cut it replaced ("even"), as explicit `split_points`.

A layout the search prices carries its cut as `split_points`, so the `conf/parallel/` file it
writes trains exactly the stages it priced; the layouts differ from the engine's own default
only when the engine would price another sequence length. A config without split points is
priced as the engine would cut it at the planner's sequence length (`settle`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from torch import nn

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.settings.placement import schedule_style
from lightning_zeropp.core.split.blocks import plan_blocks
from lightning_zeropp.core.split.cost import PieceCosts, cost_cut, rank_loads
from lightning_zeropp.core.split.profile import profile_model

__all__ = ["CUTS", "busiest_share", "piece_costs", "settle", "with_cut"]

CUTS = ("balanced", "even")


@functools.lru_cache(maxsize=512)  # a search prices many layouts of one stage layout
def _points(
    model: nn.Module,
    num_stages: int,
    schedule: str,
    pp_size: int,
    seq_len: int,
    recompute: bool,
    cut: str,
) -> tuple[int, ...]:
    even = [r.start for r in plan_blocks(model, num_stages).ranges]
    if cut == "even":
        return tuple(even[1:])
    costs = piece_costs(model, seq_len, recompute)
    return tuple(cost_cut(costs, num_stages, schedule_style(schedule), pp_size, even)[1:])


def piece_costs(model: nn.Module, seq_len: int, recompute: bool) -> PieceCosts:
    """The engine's costs (`core.split.cost.measure_costs`), from the planner's cached profile:
    one row (the cut does not depend on the rows: every figure grows with them alike)."""
    return PieceCosts.of(profile_model(model, 1, seq_len, None), seq_len, recompute)


def with_cut(
    model: nn.Module, settings: dict[str, Any], seq_len: int, cut: str, world_size: int
) -> dict[str, Any]:
    """The layout's settings with its stages cut `cut` ways (unchanged for one stage)."""
    if cut not in CUTS:
        raise ValueError(f"cut={cut!r} is not a cut; use one of {list(CUTS)}.")
    cfg = ZeroPPConfig(**settings).resolve(world_size)
    if cfg.num_stages == 1:
        return settings
    recompute = cfg.activation_checkpointing != "none"
    points = _points(model, cfg.num_stages, cfg.schedule, cfg.pp_size, seq_len, recompute, cut)
    return {**settings, "split_points": list(points)}


def settle(model: nn.Module, config: Any, seq_len: int, world_size: int) -> Any:
    """`config` with the split points the engine would choose at `seq_len` when it names none:
    what the planner's step, memory and activation figures price for such a config."""
    if config.split_points is not None:
        return config
    cfg = config.resolve(world_size)
    if cfg.num_stages == 1:
        return config
    recompute = cfg.activation_checkpointing != "none"
    points = _points(
        model, cfg.num_stages, cfg.schedule, cfg.pp_size, seq_len, recompute, "balanced"
    )
    return dataclasses.replace(config, split_points=list(points))


def busiest_share(model: nn.Module, settings: dict[str, Any], seq_len: int, world: int) -> float:
    """The busiest pipeline rank's share of one micro-batch's forward + backward FLOPs."""
    cfg = ZeroPPConfig(**settings).resolve(world)
    if cfg.num_stages == 1:
        return 1.0
    costs = piece_costs(model, seq_len, cfg.activation_checkpointing != "none")
    starts = [0, *(cfg.split_points or [])]
    loads = rank_loads(costs, starts, schedule_style(cfg.schedule), cfg.pp_size)
    return max(loads) / sum(loads)
