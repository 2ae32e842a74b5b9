"""Typed, validated settings for a ZeroPP run: the one vocabulary every front speaks.

A `ZeroPPConfig` may leave sizes unset; `resolve(world_size)` fills them in from the world size and
checks everything a user can get wrong, raising `ValueError` that names the bad value and the fix.
Every rank resolves the same config before the first collective, so a bad setting fails everywhere
at once instead of leaving some ranks waiting in a collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_zeropp.core.settings.placement import STYLES, schedule_style
from lightning_zeropp.core.settings.plus import resolve_plus

__all__ = ["ZeroPPConfig", "parse_dtype", "schedule_name", "RECOMPUTE", "GRAD_REDUCE"]

RECOMPUTE = ("none", "all", "except_last")
NONFINITE = ("raise", "skip")
GRAD_REDUCE = ("step", "unit", "microbatch")

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "16": torch.float16,
}


def parse_dtype(value: str | torch.dtype | None, name: str) -> torch.dtype | None:
    """Turn 'bf16' / 'fp32' / a torch dtype / None into a torch dtype (None means 'no cast')."""
    if value is None or isinstance(value, torch.dtype):
        return value
    key = str(value).lower().replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"{name}={value!r} is not a known dtype; use one of {sorted(_DTYPES)}.")
    return _DTYPES[key]


@dataclass(kw_only=True)
class ZeroPPConfig:
    """Layout and schedule of a ZeroPP run.

    World = pp_size x dp_replicate_size x dp_shard_size. Weights, gradients and optimizer state are
    sharded (ZeRO-3, FSDP2) over `dp_shard` (consecutive ranks, i.e. inside a node) and replicated
    over `dp_replicate` (HSDP when > 1). Each pipeline rank holds `num_chunks` model chunks.

    Defaults: `pp_size` from the other sizes when they are given, else 2 when the world splits
    into two pipeline stages (an even number of data-parallel groups) and 1 otherwise (a planner
    will choose later); `dp_shard_size` fills the rest of the world; `num_chunks` 1 for
    single-stage schedules and 2 for interleaved / V schedules; `num_microbatches` equals the number
    of pipeline ranks (the least 1F1B accepts); no resharding after forward when `pp_size > 1`
    (torchtitan's default: one gather per stage and step instead of one per micro-batch).

    `schedule="zeropp"` runs micro-batches in units of `unit_size` (U, default `pp_size`, at least
    `pp_size`); each chunk's weights are gathered once per block of a unit and released after it.
    Its backward is split into input- and weight-gradient tasks (`split_backward`, default on), and
    `grad_reduce` says when gradients are reduce-scattered: once per "step" (default), per "unit",
    or per "microbatch" (the latter two free unsharded gradients sooner, at more communication).

    `activation_checkpointing` (recomputation): False / "none", True / "all" (every block), or
    "except_last" (every block except those of the last stage, whose activations are consumed
    right after they are made: ZeroPP's policy). Recomputed stages run a full backward.

    `nonfinite`: a NaN or inf training loss raises on every rank naming the step and the stage
    ("raise", default) or drops that step's gradients on every rank ("skip"); `core.step.nonfinite`.

    ZeRO++ and offload (`core.settings.plus` describes each): `quantized_weights` (qwZ),
    `hpz_partition_size` (hpZ), `quantized_gradients` (qgZ), `gradient_error_feedback`,
    `quant_block_size`, `cpu_offload`, and `node_size` (ranks per node).

    `compile`: `torch.compile` each block after the model is cut into stages; under schedules
    that split backward into input- and weight-gradient tasks, the regions between the blocks'
    weights (`core.shard.compile`).
    """

    pp_size: int | None = None
    dp_shard_size: int | None = None
    dp_replicate_size: int = 1
    num_microbatches: int | None = None
    schedule: str = "1f1b"
    num_chunks: int | None = None
    param_dtype: torch.dtype | str | None = None
    reduce_dtype: torch.dtype | str | None = None
    activation_checkpointing: bool | str = False
    reshard_after_forward: bool | None = None
    split_points: list[int] | None = field(default=None)
    unit_size: int | None = None
    split_backward: bool | None = None
    grad_reduce: str = "step"
    nonfinite: str = "raise"
    quantized_weights: str | None = None
    hpz_partition_size: int | None = None
    quantized_gradients: str | None = None
    gradient_error_feedback: bool | None = None
    quant_block_size: int = 256
    cpu_offload: bool = False
    node_size: int | None = None
    compile: bool = False

    def resolve(self, world_size: int) -> ZeroPPConfig:
        """Return a copy with every default filled in and every setting checked."""
        cfg = dataclasses.replace(self)
        cfg.schedule = schedule_name(cfg.schedule)
        _check_positive("dp_replicate_size", cfg.dp_replicate_size)
        if cfg.pp_size is None:
            cfg.pp_size = _default_pp(world_size, cfg.dp_replicate_size, cfg.dp_shard_size)
        _check_positive("pp_size", cfg.pp_size)
        if cfg.dp_shard_size is None:
            cfg.dp_shard_size = max(world_size // (cfg.pp_size * cfg.dp_replicate_size), 1)
        _check_positive("dp_shard_size", cfg.dp_shard_size)
        product = cfg.pp_size * cfg.dp_replicate_size * cfg.dp_shard_size
        if product != world_size:
            raise ValueError(
                f"pp_size ({cfg.pp_size}) x dp_replicate_size ({cfg.dp_replicate_size}) x "
                f"dp_shard_size ({cfg.dp_shard_size}) = {product}, but the world has {world_size} "
                "processes; choose sizes whose product is the number of processes."
            )
        cfg.num_chunks = _resolve_chunks(cfg.schedule, cfg.num_chunks)
        cfg.num_microbatches = cfg.pp_size if cfg.num_microbatches is None else cfg.num_microbatches
        _check_positive("num_microbatches", cfg.num_microbatches)
        cfg.unit_size = _resolve_unit_size(cfg.schedule, cfg.unit_size, cfg.pp_size)
        _check_microbatches(cfg.schedule, cfg.num_microbatches, cfg.pp_size, cfg.num_chunks)
        cfg.param_dtype = parse_dtype(cfg.param_dtype, "param_dtype")
        cfg.reduce_dtype = parse_dtype(cfg.reduce_dtype, "reduce_dtype")
        if cfg.reshard_after_forward is None:
            cfg.reshard_after_forward = cfg.pp_size == 1
        if cfg.split_points is not None:
            cfg.split_points = _parse_split_points(cfg.split_points)
        cfg.activation_checkpointing = _resolve_recompute(cfg.activation_checkpointing)
        cfg.split_backward = _resolve_zeropp_only(
            "split_backward", cfg.split_backward, cfg.schedule, default=cfg.schedule == "zeropp"
        )
        cfg.grad_reduce = str(cfg.grad_reduce).lower()
        if cfg.grad_reduce not in GRAD_REDUCE:
            raise ValueError(
                f"grad_reduce={self.grad_reduce!r} is unknown; choose one of {list(GRAD_REDUCE)}."
            )
        cfg.nonfinite = str(cfg.nonfinite).lower()
        if cfg.nonfinite not in NONFINITE:
            raise ValueError(
                f"nonfinite={self.nonfinite!r} is unknown; choose 'raise' (stop with the step and "
                "stage named) or 'skip' (drop the step's gradients on every rank)."
            )
        if cfg.grad_reduce != "step" and cfg.schedule != "zeropp":
            raise ValueError(
                f"grad_reduce={cfg.grad_reduce!r} applies to schedule='zeropp' only (got "
                f"schedule={cfg.schedule!r}); other schedules reduce once per step."
            )
        if not isinstance(cfg.compile, bool):
            raise ValueError(f"compile={self.compile!r} must be True or False.")
        resolve_plus(cfg, world_size)
        return cfg

    def recomputes(self, stage: int) -> bool:
        """Whether stage `stage` recomputes its blocks' activations in backward (resolved config)."""
        policy = self.activation_checkpointing
        return policy == "all" or (policy == "except_last" and stage != self.num_stages - 1)

    @property
    def num_stages(self) -> int:
        """Pipeline stages in total: pp_size x num_chunks (only meaningful once resolved)."""
        assert self.pp_size is not None and self.num_chunks is not None, "resolve() first"
        return self.pp_size * self.num_chunks

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: replicas x shards."""
        assert self.dp_shard_size is not None, "resolve() first"
        return self.dp_replicate_size * self.dp_shard_size


# torch's schedule class names (as torchtitan configs spell them), matched the way torch's
# get_schedule_class matches: case-insensitively, without the "Schedule" prefix.
_ALIASES = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved1f1b": "interleaved_1f1b",
    "loopedbfs": "looped_bfs",
    "interleavedzb": "interleaved_zb",
    "interleavedzerobubble": "interleaved_zb",
    "zbv": "zbv",
    "zbvzerobubble": "zbv",
    "dualpipev": "dualpipev",
    "zeropp": "zeropp",
}


def schedule_name(name: object) -> str:
    """The library's name of a schedule given by ours or by torch's class name, any case."""
    key = str(name).lower().replace("_", "").replace("-", "").removeprefix("schedule")
    if key not in _ALIASES:
        raise ValueError(
            f"schedule={name!r} is unknown; choose one of {sorted(STYLES)} (torch's class "
            "names such as 'Interleaved1F1B' or 'ZBVZeroBubble' are accepted too)."
        )
    return _ALIASES[key]


def _default_pp(world_size: int, dp_replicate: int, dp_shard: int | None) -> int:
    """pp_size when not given: what the other sizes leave, else 2 stages when the world splits."""
    if dp_shard is not None:
        return max(world_size // (dp_replicate * dp_shard), 1)
    return 2 if world_size % (2 * dp_replicate) == 0 else 1


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer.")


def _resolve_recompute(value: bool | str) -> str:
    if isinstance(value, bool):
        return "all" if value else "none"
    policy = str(value).lower()
    if policy not in RECOMPUTE:
        raise ValueError(
            f"activation_checkpointing={value!r} is unknown; use True/False or one of {RECOMPUTE}."
        )
    return policy


def _resolve_zeropp_only(name: str, value: bool | None, schedule: str, default: bool) -> bool:
    if value is None:
        return default
    if value and schedule != "zeropp":
        raise ValueError(
            f"{name}=True applies to schedule='zeropp' only (got schedule={schedule!r}); torch's "
            "zero-bubble schedules ('interleaved_zb', 'zbv', 'dualpipev') split backward themselves."
        )
    return bool(value)


def _resolve_chunks(schedule: str, num_chunks: int | None) -> int:
    style = schedule_style(schedule)
    if num_chunks is None:
        return 1 if style == "single" else 2
    _check_positive("num_chunks", num_chunks)
    if style == "single" and num_chunks != 1:
        raise ValueError(
            f"num_chunks={num_chunks} needs a multi-stage schedule, but schedule={schedule!r} runs "
            "one stage per rank; use schedule='interleaved_1f1b' (or another interleaved schedule) "
            "or num_chunks=1."
        )
    if style == "v" and num_chunks != 2:
        raise ValueError(
            f"schedule={schedule!r} places exactly 2 stages per rank in a V; got num_chunks="
            f"{num_chunks}. Use num_chunks=2."
        )
    return num_chunks


def _resolve_unit_size(schedule: str, unit_size: int | None, pp: int) -> int | None:
    if schedule != "zeropp":
        if unit_size is not None:
            raise ValueError(
                f"unit_size={unit_size} applies to schedule='zeropp' only (got schedule={schedule!r})."
            )
        return None
    unit_size = pp if unit_size is None else unit_size
    _check_positive("unit_size", unit_size)
    if unit_size < pp:
        raise ValueError(
            f"unit_size={unit_size} is smaller than pp_size={pp}: the first pipeline rank would stall "
            f"inside every unit. Use unit_size >= {pp}."
        )
    return unit_size


def _check_microbatches(schedule: str, m: int, pp: int, v: int) -> None:
    """Mirror the schedule constructors' own limits so the error comes early and names the fix."""
    if schedule == "zeropp":  # any M: the last unit may be smaller than the others, even than pp
        return
    needs_pp = schedule in ("1f1b", "dualpipev") or (
        schedule_style(schedule) != "single" and pp > 1
    )
    if needs_pp and m < pp and pp > 1:
        raise ValueError(
            f"num_microbatches={m} is too few for schedule={schedule!r} with pp_size={pp}: it needs "
            f"at least {pp}. Raise num_microbatches to a multiple of {pp}."
        )
    if schedule_style(schedule) == "looped" and pp > 1:
        rounds = max(1, m // pp)
        if m % rounds != 0:
            raise ValueError(
                f"num_microbatches={m} must be a multiple of {rounds} (= num_microbatches // "
                f"pp_size) for schedule={schedule!r}; use a multiple of pp_size={pp}."
            )


def _parse_split_points(points: Any) -> list[int]:
    """Block indices, from a list (or a comma-separated string, as an environment variable
    gives them); a bad entry is named with the setting."""
    items = points.split(",") if isinstance(points, str) else points
    try:
        values = list(items)
        if any(isinstance(p, bool) or float(p) != int(float(p)) for p in values):
            raise ValueError
        return [int(float(p)) for p in values]
    except (TypeError, ValueError):
        raise ValueError(
            f"split_points={points!r} must be a list of integer block indices (where stages "
            "1, 2, ... start), e.g. split_points=[4, 8]."
        ) from None
