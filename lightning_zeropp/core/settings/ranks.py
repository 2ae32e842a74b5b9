"""Activation policies per pipeline rank: which ranks offload their saved activations to host
memory (`offload_activations`) and which recompute them (`recompute_ranks`).

Under the 1F1B family a pipeline rank holds as many micro-batches in flight as it runs forwards
before its first backward: the first rank the most, the last one. `in_flight` counts them as the
schedules' orders do (torch's 1F1B: min(M, pp - r); interleaved: (v - 1) pp + 2 (pp - 1 - r) + 1
chunks, capped at M v), and `offload_activations="auto"` offloads the ranks holding more than the
mean, the first half under 1F1B. Schedules that hold about the same on every rank (GPipe, looped
BFS, ZeroPP's units, the V-shapes, whose ranks each hold a first and a last stage) have nothing
to balance: "auto" offloads no rank there ("on", or a list of ranks, does). Torch-free.
"""

from __future__ import annotations

from typing import Any

from lightning_zeropp.core.settings.placement import rank_of_stage, schedule_style
from lightning_zeropp.core.settings.values import setting_error

__all__ = ["OFFLOAD", "in_flight", "offload_ranks", "resolve_rank_policies", "stage_rank"]

OFFLOAD = ("off", "on", "auto")

# Schedules whose ranks hold fewer micro-batches in flight down the pipeline. ZeroPP's units
# keep every rank's count about level (the planner's peaks for Llama-3-8B at pp 4: 24.5, 27.6,
# 27.6, 26.7 GiB; bench/results/offload.md): nothing for "auto" to balance there.
_FALLING = ("1f1b", "interleaved_1f1b", "interleaved_zb")


def in_flight(schedule: str, pp: int, v: int, m: int, rank: int) -> int:
    """Forward chunks pipeline rank `rank` runs before its first backward (micro-batches whose
    activations it holds at once), as the schedule orders them."""
    if schedule not in _FALLING or pp == 1:
        return m * v
    if v == 1:
        return min(m, pp - rank)
    return min(m * v, (v - 1) * pp + 2 * (pp - 1 - rank) + 1)


def offload_ranks(policy: str | list[int], schedule: str, pp: int, v: int, m: int) -> list[int]:
    """Pipeline ranks whose stages offload under `policy` ("off", "on", "auto", or the ranks)."""
    if isinstance(policy, list):
        return policy
    if policy == "on":
        return list(range(pp))
    if policy == "off":
        return []
    held = [in_flight(schedule, pp, v, m, r) for r in range(pp)]
    mean = sum(held) / pp
    return [r for r in range(pp) if held[r] > mean]


def stage_rank(schedule: str, stage: int, pp: int) -> int:
    """The pipeline rank holding global stage `stage`."""
    return rank_of_stage(schedule_style(schedule), stage, pp)


def resolve_rank_policies(cfg: Any) -> None:
    """`offload_activations` to one of OFFLOAD (or a list of pipeline ranks) and
    `recompute_ranks` checked (in place; after the sizes, the schedule and
    `activation_checkpointing` are resolved)."""
    value = cfg.offload_activations
    if isinstance(value, list | tuple):
        cfg.offload_activations = _ranks("offload_activations", value, cfg.pp_size)
        value = "on"  # checked
    policy = ("on" if value else "off") if isinstance(value, bool) else str(value).lower()
    if policy not in OFFLOAD:
        raise setting_error(
            "offload_activations",
            f"offload_activations={value!r} is unknown; use True/False or one of {OFFLOAD} "
            "('auto': the pipeline ranks holding the most micro-batches in flight).",
        )
    if not isinstance(cfg.offload_activations, list):
        cfg.offload_activations = policy
    ranks = cfg.recompute_ranks
    if ranks is None:
        return
    parsed = _ranks("recompute_ranks", ranks, cfg.pp_size)
    if cfg.activation_checkpointing == "none":
        raise setting_error(
            ("recompute_ranks", "activation_checkpointing"),
            f"recompute_ranks={ranks!r} says which pipeline ranks recompute, but "
            "activation_checkpointing is off: set activation_checkpointing=True (or "
            "'except_last') to recompute on those ranks, or leave recompute_ranks unset.",
        )
    cfg.recompute_ranks = parsed


def _ranks(name: str, ranks: Any, pp: int) -> list[int]:
    """A list of distinct pipeline ranks below `pp`, from a list or "0,1"; else an error."""
    items = ranks.split(",") if isinstance(ranks, str) else list(ranks)
    try:
        parsed = sorted({int(r) for r in items if not isinstance(r, bool) and str(r).strip()})
        if len(parsed) != len([r for r in items if str(r).strip()]):
            raise ValueError
    except (TypeError, ValueError):
        raise setting_error(
            name, f"{name}={ranks!r} must be a list of distinct pipeline ranks, e.g. [0, 1]."
        ) from None
    bad = [r for r in parsed if not 0 <= r < pp]
    if bad:
        raise setting_error(
            (name, "pp_size"),
            f"{name}={ranks!r} names pipeline ranks {bad} outside 0..{pp - 1} "
            f"(pp_size={pp}); name ranks below pp_size.",
        )
    return parsed
