"""Resolution: a `ZeroPPConfig` (what was asked) becomes a `ZeroPPLayout` (what runs).

`resolve_config(config, world_size, node_size)` fills in every default from the world and checks
every setting against the others, raising a `ValueError` that names the bad
value, the fix, and the settings it concerns. It is pure: no environment variable is read (the
fronts read the launcher's node size and the `ZEROPP_*` variables themselves, in
`fronts.settings`). The result, a `ZeroPPLayout` (`core.settings.layout`), is frozen and fully
typed, so the engine, the planner and the fronts read sizes and policies without checking for None.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from lightning_zeropp.core.settings.launch import restart_note
from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.settings.placement import (
    SPLIT_BACKWARD_SCHEDULES,
    schedule_style,
    splits_backward,
)
from lightning_zeropp.core.settings.plus import resolve_plus
from lightning_zeropp.core.settings.ranks import resolve_rank_policies
from lightning_zeropp.core.settings.values import (
    GRAD_REDUCE,
    NONFINITE,
    RECOMPUTE,
    parse_dtype,
    schedule_name,
    setting_error,
)

if TYPE_CHECKING:
    from lightning_zeropp.core.settings.config import ZeroPPConfig

__all__ = ["resolve_config"]


def resolve_config(
    config: ZeroPPConfig | ZeroPPLayout, world_size: int, node_size: int | None = None
) -> ZeroPPLayout:
    """`config` resolved for `world_size` processes, `node_size` of them per node."""
    if isinstance(config, ZeroPPLayout):
        return config.resolve(world_size, node_size)
    cfg = SimpleNamespace(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
    if cfg.node_size is None:
        cfg.node_size = node_size if node_size is not None else world_size
    _resolve_sizes(cfg, world_size)
    _resolve_schedule(cfg)
    _resolve_policies(cfg)
    resolve_plus(cfg, world_size)
    resolve_rank_policies(cfg)
    return ZeroPPLayout(world_size=world_size, **vars(cfg))


def _resolve_sizes(cfg: Any, world_size: int) -> None:
    cfg.schedule = schedule_name(cfg.schedule)
    _check_positive("dp_replicate_size", cfg.dp_replicate_size)
    _check_positive("cp_size", cfg.cp_size)
    if world_size % cfg.cp_size:
        raise setting_error(
            "cp_size",
            f"cp_size={cfg.cp_size} does not divide the world of {world_size} processes; "
            f"choose a cp_size that divides {world_size} (world = pp_size x dp_replicate_size "
            "x dp_shard_size x cp_size).",
        )
    others = world_size // cfg.cp_size  # what the pipeline and data-parallel axes share
    if cfg.pp_size is None:
        cfg.pp_size = _default_pp(others, cfg.dp_replicate_size, cfg.dp_shard_size)
    _check_positive("pp_size", cfg.pp_size)
    if cfg.dp_shard_size is None:
        cfg.dp_shard_size = max(others // (cfg.pp_size * cfg.dp_replicate_size), 1)
    _check_positive("dp_shard_size", cfg.dp_shard_size)
    product = cfg.pp_size * cfg.dp_replicate_size * cfg.dp_shard_size * cfg.cp_size
    cp = f" x cp_size ({cfg.cp_size})" if cfg.cp_size > 1 else ""  # named when it is used
    if product != world_size:
        raise setting_error(
            ("pp_size", "dp_replicate_size", "dp_shard_size", "cp_size"),
            f"pp_size ({cfg.pp_size}) x dp_replicate_size ({cfg.dp_replicate_size}) x "
            f"dp_shard_size ({cfg.dp_shard_size}){cp} = {product}, but the world has "
            f"{world_size} processes; choose sizes whose product is the number of processes."
            + restart_note(world_size, cfg.pp_size * cfg.dp_replicate_size * cfg.cp_size),
        )
    _check_context(cfg)


def _check_context(cfg: Any) -> None:
    """Context parallelism runs with every setting but these, refused by name (ZeRO++'s act on
    FSDP's shard group, dp_shard x cp, as they do on dp_shard alone)."""
    if cfg.cp_size == 1:
        return
    unsupported = {"compile": cfg.compile or None}
    for name, value in unsupported.items():
        if value is not None:
            raise setting_error(
                (name, "cp_size"),
                f"{name}={value!r} cannot be combined with cp_size={cfg.cp_size} yet; leave "
                f"{name} unset, or set cp_size=1.",
            )


def _resolve_schedule(cfg: Any) -> None:
    cfg.num_chunks = _resolve_chunks(cfg.schedule, cfg.num_chunks)
    cfg.num_microbatches = cfg.pp_size if cfg.num_microbatches is None else cfg.num_microbatches
    _check_positive("num_microbatches", cfg.num_microbatches)
    cfg.unit_size = _resolve_unit_size(cfg.schedule, cfg.unit_size, cfg.pp_size)
    _check_microbatches(cfg.schedule, cfg.num_microbatches, cfg.pp_size)
    if cfg.split_points is not None:
        cfg.split_points = _parse_split_points(cfg.split_points)
    cfg.split_backward = _resolve_zeropp_only(
        "split_backward", cfg.split_backward, cfg.schedule, default=cfg.schedule == "zeropp"
    )
    grad_reduce = str(cfg.grad_reduce).lower()
    if grad_reduce not in GRAD_REDUCE:
        raise setting_error(
            "grad_reduce",
            f"grad_reduce={cfg.grad_reduce!r} is unknown; choose one of {list(GRAD_REDUCE)}.",
        )
    if grad_reduce != "step" and cfg.schedule != "zeropp":
        raise setting_error(
            ("grad_reduce", "schedule"),
            f"grad_reduce={grad_reduce!r} applies to schedule='zeropp' only (got "
            f"schedule={cfg.schedule!r}); other schedules reduce once per step.",
        )
    cfg.grad_reduce = grad_reduce


def _resolve_policies(cfg: Any) -> None:
    cfg.param_dtype = parse_dtype(cfg.param_dtype, "param_dtype")
    cfg.reduce_dtype = parse_dtype(cfg.reduce_dtype, "reduce_dtype")
    split = splits_backward(cfg.schedule, cfg.split_backward)
    if cfg.reshard_after_forward is None:
        cfg.reshard_after_forward = cfg.pp_size == 1 and not split
    elif cfg.reshard_after_forward and split:
        # The input-gradient task would find the weights resharded and hand the weight-gradient
        # task no parameters: their gradients were silently lost.
        raise setting_error(
            ("reshard_after_forward", "schedule", "split_backward"),
            f"reshard_after_forward=True cannot be combined with schedule={cfg.schedule!r}, "
            "which splits backward into input- and weight-gradient tasks: the weights are "
            "resharded between them and the weight gradients would be lost. Leave "
            "reshard_after_forward unset (False for these schedules), or use a schedule with a "
            "full backward ('1f1b', 'interleaved_1f1b'; for 'zeropp', split_backward=False).",
        )
    cfg.reshard_after_forward = bool(cfg.reshard_after_forward)
    cfg.activation_checkpointing = _resolve_recompute(cfg.activation_checkpointing)
    nonfinite = str(cfg.nonfinite).lower()
    if nonfinite not in NONFINITE:
        raise setting_error(
            "nonfinite",
            f"nonfinite={cfg.nonfinite!r} is unknown; choose 'raise' (stop with the step and "
            "stage named) or 'skip' (drop the step's gradients on every rank).",
        )
    cfg.nonfinite = nonfinite
    if not isinstance(cfg.compile, bool):
        raise setting_error("compile", f"compile={cfg.compile!r} must be True or False.")
    if cfg.loss_chunk is not None and (
        isinstance(cfg.loss_chunk, bool)
        or not isinstance(cfg.loss_chunk, int)
        or cfg.loss_chunk < 0
    ):
        raise setting_error(
            "loss_chunk",
            f"loss_chunk={cfg.loss_chunk!r} must be a whole number of tokens >= 0 (0: the head "
            "and the loss over whole logits) or None (1024 where the run can chunk).",
        )
    if not isinstance(cfg.save_on_sigterm, bool):
        raise setting_error(
            "save_on_sigterm", f"save_on_sigterm={cfg.save_on_sigterm!r} must be True or False."
        )


def _default_pp(world_size: int, dp_replicate: int, dp_shard: int | None) -> int:
    """pp_size when not given: what the other sizes leave, else 2 stages when the world splits."""
    if dp_shard is not None:
        return max(world_size // (dp_replicate * dp_shard), 1)
    return 2 if world_size % (2 * dp_replicate) == 0 else 1


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise setting_error(name, f"{name}={value!r} must be a positive integer.")


def _resolve_recompute(value: bool | str) -> str:
    if isinstance(value, bool):
        return "all" if value else "none"
    policy = str(value).lower()
    if policy not in RECOMPUTE:
        raise setting_error(
            "activation_checkpointing",
            f"activation_checkpointing={value!r} is unknown; use True/False or one of {RECOMPUTE}.",
        )
    return policy


def _resolve_zeropp_only(name: str, value: bool | None, schedule: str, default: bool) -> bool:
    if value is None:
        return default
    if value and schedule != "zeropp":
        raise setting_error(
            (name, "schedule"),
            f"{name}=True applies to schedule='zeropp' only (got schedule={schedule!r}); torch's "
            f"zero-bubble schedules {SPLIT_BACKWARD_SCHEDULES} split backward themselves.",
        )
    return bool(value)


def _resolve_chunks(schedule: str, num_chunks: int | None) -> int:
    style = schedule_style(schedule)
    if num_chunks is None:
        return 1 if style == "single" else 2
    _check_positive("num_chunks", num_chunks)
    if style == "single" and num_chunks != 1:
        raise setting_error(
            ("num_chunks", "schedule"),
            f"num_chunks={num_chunks} needs a multi-stage schedule, but schedule={schedule!r} runs "
            "one stage per rank; use schedule='interleaved_1f1b' (or another interleaved schedule) "
            "or num_chunks=1.",
        )
    if style == "v" and num_chunks != 2:
        raise setting_error(
            ("num_chunks", "schedule"),
            f"schedule={schedule!r} places exactly 2 stages per rank in a V; got num_chunks="
            f"{num_chunks}. Use num_chunks=2.",
        )
    return num_chunks


def _resolve_unit_size(schedule: str, unit_size: int | None, pp: int) -> int | None:
    if schedule != "zeropp":
        if unit_size is not None:
            raise setting_error(
                ("unit_size", "schedule"),
                f"unit_size={unit_size} applies to schedule='zeropp' only (got "
                f"schedule={schedule!r}).",
            )
        return None
    unit_size = pp if unit_size is None else unit_size
    _check_positive("unit_size", unit_size)
    if unit_size < pp:
        raise setting_error(
            ("unit_size", "pp_size"),
            f"unit_size={unit_size} is smaller than pp_size={pp}: the first pipeline rank would "
            f"stall inside every unit. Use unit_size >= {pp}.",
        )
    return unit_size


def _check_microbatches(schedule: str, m: int, pp: int) -> None:
    """Mirror the schedule constructors' own limits so the error comes early and names the fix."""
    if schedule == "zeropp":  # any M: the last unit may be smaller than the others, even than pp
        return
    needs_pp = schedule in ("1f1b", "dualpipev") or (
        schedule_style(schedule) != "single" and pp > 1
    )
    if needs_pp and m < pp and pp > 1:
        raise setting_error(
            ("num_microbatches", "pp_size"),
            f"num_microbatches={m} is too few for schedule={schedule!r} with pp_size={pp}: it "
            f"needs at least {pp}. Raise num_microbatches to a multiple of {pp}.",
        )
    if schedule_style(schedule) == "looped" and pp > 1:
        rounds = max(1, m // pp)
        if m % rounds != 0:
            raise setting_error(
                ("num_microbatches", "pp_size"),
                f"num_microbatches={m} must be a multiple of {rounds} (= num_microbatches // "
                f"pp_size) for schedule={schedule!r}; use a multiple of pp_size={pp}.",
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
        raise setting_error(
            "split_points",
            f"split_points={points!r} must be a list of integer block indices (where stages "
            "1, 2, ... start), e.g. split_points=[4, 8].",
        ) from None
