"""The words settings are written in: dtypes and schedule names as users spell them, the policies'
names, and `setting_error`, which records which settings a bad value concerns (so a front can name
the `ZEROPP_*` variable that set it). The ground floor of `settings/`: imports torch only.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Literal

import torch

from lightning_zeropp.core.settings.placement import SCHEDULE_ROWS, STYLES

__all__ = [
    "GRAD_REDUCE",
    "GradReduce",
    "NONFINITE",
    "RECOMPUTE",
    "fields_of",
    "parse_dtype",
    "schedule_name",
    "setting_error",
]

RECOMPUTE = ("none", "all", "except_last")
NONFINITE = ("raise", "skip")
GradReduce = Literal["step", "unit", "microbatch"]
GRAD_REDUCE: tuple[GradReduce, ...] = typing.get_args(GradReduce)

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


def setting_error(fields: str | Sequence[str], message: str) -> ValueError:
    """The `ValueError` for a bad setting, carrying the names of the settings it concerns
    (`.fields`, read by `fields_of`): users see a plain `ValueError` naming value and fix."""
    err = ValueError(message)
    err.fields = (fields,) if isinstance(fields, str) else tuple(fields)  # type: ignore[attr-defined]
    return err


def fields_of(err: BaseException) -> tuple[str, ...]:
    """The settings a `setting_error` concerns (none for any other error)."""
    return getattr(err, "fields", ())


def parse_dtype(value: str | torch.dtype | None, name: str) -> torch.dtype | None:
    """Turn 'bf16' / 'fp32' / a torch dtype / None into a torch dtype (None means 'no cast')."""
    if value is None or isinstance(value, torch.dtype):
        return value
    key = str(value).lower().replace("torch.", "")
    if key not in _DTYPES:
        raise setting_error(
            name, f"{name}={value!r} is not a known dtype; use one of {sorted(_DTYPES)}."
        )
    return _DTYPES[key]


def _alias_key(name: object) -> str:
    """A schedule name as torch's get_schedule_class matches it: any case, without underscores,
    dashes or the "Schedule" prefix."""
    return str(name).lower().replace("_", "").replace("-", "").removeprefix("schedule")


# Ours and torch's class names (as torchtitan configs spell them), from the schedule table.
_ALIASES = {
    _alias_key(alias): row.name
    for row in SCHEDULE_ROWS
    for alias in (row.name, row.torch_class or row.name, *row.aliases)
}


def schedule_name(name: object) -> str:
    """The library's name of a schedule given by ours or by torch's class name, any case."""
    key = _alias_key(name)
    if key not in _ALIASES:
        raise setting_error(
            "schedule",
            f"schedule={name!r} is unknown; choose one of {sorted(STYLES)} (torch's class "
            "names such as 'Interleaved1F1B' or 'ZBVZeroBubble' are accepted too).",
        )
    return _ALIASES[key]
