"""Activations balanced across pipeline ranks: recomputation and offload chosen per rank.

Under the 1F1B family the first pipeline ranks hold the most micro-batches in flight
(`core.settings.ranks.in_flight`), so a layout that does not fit often fails on those ranks
only. Recomputing everywhere (`activation_checkpointing=True`) pays the forward again on every
rank; `per_rank_variants` instead names the ranks over the budget and offers two layouts that
act there only: recompute on those ranks (`recompute_ranks`), and offload their activations to
host memory (`offload_activations`, priced over the cluster's host link, `Hardware.host_Bps`;
not offered without one). The search prices both with the others and keeps what fits.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.plan.hardware import Hardware
from lightning_zeropp.plan.peaks import rank_memory

__all__ = ["over_budget", "per_rank_variants"]


def over_budget(totals: list[dict[str, int]], dp_size: int, budget: int) -> list[int]:
    """The pipeline ranks with a rank whose predicted total exceeds `budget` (`rank_memory`'s
    list, ranks pp-major)."""
    return sorted({rank // dp_size for rank, t in enumerate(totals) if t["total"] > budget})


def per_rank_variants(
    model: nn.Module,
    settings: dict[str, Any],
    world_size: int,
    global_batch: int,
    seq_len: int,
    hardware: Hardware,
    optimizer: str = "adamw",
) -> list[tuple[dict[str, Any], int]]:
    """Layouts like `settings` (one that recomputes nowhere and offloads nothing) that recompute,
    or offload, on the pipeline ranks over `hardware.memory_bytes` only, and fit: each with the
    most any rank then needs. Empty when it fits already, or every rank is over."""
    budget = hardware.memory_bytes
    cfg = ZeroPPConfig(**settings).resolve(world_size)
    if budget is None or cfg.activation_checkpointing != "none" or cfg.offload_activations != "off":
        return []
    device = "cuda" if hardware.overlap else "cpu"
    totals = rank_memory(model, cfg, world_size, global_batch, seq_len, optimizer, device)
    over = over_budget(totals, cfg.dp_size, budget)
    if not over or len(over) == cfg.pp_size:
        return []
    variants = [{**settings, "activation_checkpointing": "all", "recompute_ranks": over}]
    if hardware.host_Bps is not None:
        variants.append({**settings, "offload_activations": over})
    out = []
    for variant in variants:
        memory = max(
            r["total"]
            for r in rank_memory(
                model, ZeroPPConfig(**variant), world_size, global_batch, seq_len, optimizer,
                device,
            )
        )  # fmt: skip
        if memory <= budget:
            out.append((variant, memory))
    return out
