"""The planner's search run per context-parallel size (`cp_size`): the fastest layouts that fit
at each cp, so `python -m lightning_zeropp.plan` and the CP benchmark can name the best of each
as well as the best of all. Beside `plan.search`, not in `plan.context`, which the step-time
model below the search reads (a search there made the planner's modules a circle)."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_zeropp.plan.search import search


def search_by_cp(
    model: nn.Module,
    world_size: int,
    global_batch: int,
    seq_len: int,
    hardware: Any,
    layouts: list[dict[str, Any]],
    **kwargs: Any,
) -> dict[int, list[Any]]:
    """`plan.search.search` run over the layouts of each cp size apart: per cp, its fastest
    layouts that fit (a list, empty where none fits), so a caller can name the best of each
    as well as the best of all. Each layout is priced once, as in one search."""
    sizes = sorted({s.get("cp_size", 1) for s in layouts})
    return {
        cp: search(
            model,
            world_size,
            global_batch,
            seq_len,
            hardware,
            layouts=[s for s in layouts if s.get("cp_size", 1) == cp],
            **kwargs,
        )  # fmt: skip
        for cp in sizes
    }
