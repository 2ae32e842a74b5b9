"""The layout search: every layout of a world that fits each rank's memory, ranked by predicted
step time.

A layout is pp x dp_replicate x dp_shard x cp (context parallelism, a CP group inside a node:
`plan.context`), a schedule (FSDP alone when pp is 1; 1F1B, interleaved
1F1B, ZB-V, ZeroPP with its chunks v and unit U), a micro-batch count and recomputation; the
compute and reduce dtypes and the optimizer are the caller's (`base`). A layout over the memory
on some pipeline ranks only is offered again recomputing, or offloading, there only
(`plan.per_rank`). Memory per rank is `plan.peaks.rank_memory`.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.split.blocks import find_blocks
from lightning_zeropp.plan.cut import with_cut
from lightning_zeropp.plan.hardware import Hardware
from lightning_zeropp.plan.loss_chunk import with_whole_logits
from lightning_zeropp.plan.peaks import rank_memory
from lightning_zeropp.plan.per_rank import per_rank_variants
from lightning_zeropp.plan.steptime import StepTimePlan, predict_range, price

__all__ = ["Candidate", "context_sizes", "enumerate_layouts", "search"]

RECOMPUTE = ("none", "except_last", "all")


@dataclass(frozen=True)
class Candidate:
    """A layout that fits, with its predictions: `step` at the middle of the hardware's
    efficiency range, `slow` and `fast` at its ends (the same plan when it has no range)."""

    settings: dict[str, Any]  # ZeroPPConfig keyword arguments
    memory_bytes: int  # the most any rank needs
    step: StepTimePlan
    slow: StepTimePlan | None = None
    fast: StepTimePlan | None = None

    @property
    def step_s(self) -> float:
        return self.step.step_s

    @property
    def step_range_s(self) -> tuple[float, float]:
        """(fast, slow) step seconds."""
        return ((self.fast or self.step).step_s, (self.slow or self.step).step_s)


def _layout(settings: dict[str, Any], world_size: int) -> ZeroPPLayout:
    """A candidate's settings resolved, once: the planner's entries take the layout as it is."""
    return ZeroPPConfig(**settings).resolve(world_size)


def enumerate_layouts(
    world_size: int,
    num_blocks: int,
    global_batch: int,
    node_size: int,
    base: dict[str, Any] | None = None,
    max_microbatches: int = 64,
    micro_batch: int | None = None,
    seq_len: int | None = None,
    cp_sizes: Sequence[int] | None = None,
) -> Iterator[dict[str, Any]]:
    """Every layout of the search space, as ZeroPPConfig keyword arguments (each resolves);
    with `micro_batch`, only those whose micro-batches have that many rows.

    Context parallelism: `cp_sizes` (default, given `seq_len`: every cp that divides the node,
    so a CP group sits inside a node, and splits `seq_len` into 2 x cp chunks; without
    `seq_len`, cp 1 only)."""
    # ranks per node: the planned cluster's, not the launcher's LOCAL_WORLD_SIZE
    base = {"node_size": node_size, **(base or {})}
    if cp_sizes is None:
        cp_sizes = [1] if seq_len is None else context_sizes(world_size, node_size, seq_len)
    for cp, pp in itertools.product(cp_sizes, _divisors(world_size)):
        if pp > num_blocks or world_size % (cp * pp):
            continue
        dp = world_size // (pp * cp)
        if global_batch % dp:
            continue
        rows = global_batch // dp
        for shard in _divisors(dp):
            # a shard group (dp_shard x cp) spanning nodes: only the whole of dp
            if shard * cp > node_size and shard != dp:
                continue
            sizes = {"pp_size": pp, "dp_shard_size": shard, "dp_replicate_size": dp // shard}
            sizes.update({"cp_size": cp} if cp > 1 else {})
            for m, (schedule, extra), recompute in itertools.product(
                [
                    m
                    for m in _divisors(rows)
                    if m <= max_microbatches and micro_batch in (None, rows // m)
                ],
                _schedules(pp, num_blocks, rows),
                RECOMPUTE,
            ):
                if recompute == "except_last" and schedule != "zeropp":
                    continue
                if extra.get("unit_size", 0) > m:
                    continue
                settings = {**base, **sizes, "num_microbatches": m, "schedule": schedule, **extra}
                settings["activation_checkpointing"] = recompute
                try:
                    ZeroPPConfig(**settings).resolve(world_size)
                except ValueError:
                    continue  # e.g. too few micro-batches for the schedule
                yield settings


def context_sizes(world_size: int, node_size: int, seq_len: int) -> list[int]:
    """The cp sizes a search tries: those dividing the node (a CP group inside one node) and the
    world, that split `seq_len` into 2 x cp equal chunks."""
    return [
        cp
        for cp in _divisors(node_size)
        if cp == 1 or (world_size % cp == 0 and seq_len % (2 * cp) == 0)
    ]


def _schedules(pp: int, num_blocks: int, rows: int) -> list[tuple[str, dict[str, Any]]]:
    if pp == 1:
        return [("1f1b", {})]
    out: list[tuple[str, dict[str, Any]]] = [("1f1b", {})]
    if 2 * pp <= num_blocks:
        out += [("interleaved_1f1b", {"num_chunks": 2}), ("zbv", {})]
    for v in (2, 4):
        if v * pp <= num_blocks:
            out += [("zeropp", {"num_chunks": v, "unit_size": u}) for u in (pp, 2 * pp, 4 * pp)]
            # without split backward: more bubble, less memory (no activations held for W),
            # and it compiles where torch's split backward does not
            out += [
                ("zeropp", {"num_chunks": v, "unit_size": u, "split_backward": False})
                for u in (pp, 2 * pp, 4 * pp)
            ]
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(
    model: nn.Module,
    world_size: int,
    global_batch: int,
    seq_len: int,
    hardware: Hardware,
    *,
    base: dict[str, Any] | None = None,
    optimizer: str = "adamw",
    top: int = 10,
    layouts: Sequence[dict[str, Any]] | None = None,
    compiled: bool | None = None,
    cut: str = "balanced",
    per_rank: bool | None = None,
) -> list[Candidate]:
    """The `top` fastest layouts whose every rank fits `hardware.memory_bytes` (all of them
    when it is None), fastest first. `layouts` replaces the enumerated space. `compiled` and
    as in `predict_step_time` (None: each layout's `compile`): ranked at the middle of the
    hardware's efficiency range, with the ends of it for the `top` returned.

    `cut`: how a layout without `split_points` is cut into stages (`plan.cut`): "balanced" (the
    engine's default, by cost; a layout whose balanced cut does not fit is priced with the
    parameter cut instead) or "even" (by parameters); the cut is in each candidate's settings.

    `per_rank` (default: on for the enumerated space, off for given `layouts`): a layout over
    the memory on some pipeline ranks only is also priced recomputing, or offloading, on those
    ranks only (`plan.per_rank`)."""
    per_rank = layouts is None if per_rank is None else per_rank
    num_blocks = len(find_blocks(model)[1])
    space = (
        layouts
        if layouts is not None
        else list(
            enumerate_layouts(
                world_size, num_blocks, global_batch, hardware.node_size, base, seq_len=seq_len
            )
        )
    )
    space = [
        s if s.get("split_points") else with_cut(model, s, seq_len, cut, world_size) for s in space
    ]
    if layouts is None:
        space = with_whole_logits(model, space, world_size, global_batch, seq_len)
    device = "cuda" if hardware.overlap else "cpu"
    modes: dict[str, Any] = {"compiled": compiled}
    # Cheapest first: price every layout, then simulate in order of the bound no simulation
    # can beat, and stop once that bound is worse than the `top`-th step found (a layout whose
    # step could tie it is still simulated).
    priced = []
    for i, settings in enumerate(space):
        costs = price(
            model, _layout(settings, world_size), world_size, global_batch, seq_len, hardware,
            optimizer=optimizer, **modes,
        )  # fmt: skip
        priced.append((costs.lower_bound(), i, settings, costs))
    priced.sort(key=lambda p: p[:2])
    ranked: list[tuple[float, int, int, Candidate]] = []  # (step, memory, order, candidate)
    for bound, i, settings, costs in priced:
        if len(ranked) >= top and bound > ranked[top - 1][0] * (1 + 1e-9):
            break
        memory = max(
            r["total"]
            for r in rank_memory(
                model, costs.cfg, world_size, global_batch, seq_len, optimizer, device
            )
        )  # fmt: skip
        if hardware.memory_bytes is not None and memory > hardware.memory_bytes:
            # recompute or offload on the ranks over the budget only (`plan.per_rank`)
            variants = (
                per_rank_variants(
                    model, settings, world_size, global_batch, seq_len, hardware, optimizer
                )
                if per_rank
                else []
            )
            for variant, fits in variants:
                plan = price(
                    model, ZeroPPConfig(**variant), world_size, global_batch, seq_len, hardware,
                    optimizer=optimizer, **modes,
                ).plan()  # fmt: skip
                bisect.insort(ranked, (plan.step_s, fits, i, Candidate(variant, fits, plan)))
            even = with_cut(model, {**settings, "split_points": None}, seq_len, "even", world_size)
            if cut == "even" or even == settings:
                continue
            settings = even  # within memory: the parameter cut, if it fits where this did not
            costs = price(
                model, _layout(settings, world_size), world_size, global_batch, seq_len, hardware,
                optimizer=optimizer, **modes,
            )  # fmt: skip
            memory = max(
                r["total"]
                for r in rank_memory(
                    model, costs.cfg, world_size, global_batch, seq_len, optimizer, device
                )
            )  # fmt: skip
            if memory > hardware.memory_bytes:
                continue
        step = costs.plan()
        bisect.insort(ranked, (step.step_s, memory, i, Candidate(settings, memory, step)))
    found = [c for *_, c in ranked]
    if not hardware.efficiency:
        return found[:top]
    return [
        dataclasses.replace(
            c,
            **dict[str, Any](
                zip(
                    ("slow", "fast"),
                    predict_range(
                        model,
                        ZeroPPConfig(**c.settings),
                        world_size,
                        global_batch,
                        seq_len,
                        hardware,
                        optimizer=optimizer,
                        **modes,
                    ),  # fmt: skip
                    strict=True,
                )
            ),
        )
        for c in found[:top]
    ]


def as_parallel_config(candidate: Candidate, world_size: int) -> dict[str, Any]:
    """The candidate as a `conf/parallel/` mapping (every key a ZeroPPConfig setting)."""
    cfg = ZeroPPConfig(**candidate.settings).resolve(world_size)
    keys = [f.name for f in dataclasses.fields(ZeroPPConfig)]
    out = {k: getattr(cfg, k) for k in keys}
    for key in ("param_dtype", "reduce_dtype"):
        if out[key] is not None:
            out[key] = str(out[key]).replace("torch.", "")
    return out
