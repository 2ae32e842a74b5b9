"""ZeroPP settings from `ZEROPP_*` environment variables, read the same way by both fronts.

`accelerate launch` rejects unknown keys in its YAML config, so pipeline settings reach a script
the way Accelerate's own `FSDP_*` settings do: as environment variables, one per `ZeroPPConfig`
field (`ZEROPP_PP_SIZE=2`, `ZEROPP_SCHEDULE=1f1b`, ...), plus `ZEROPP_SPLIT` for the split method
and `ZEROPP_CHECK_BATCH=1`, a debugging check that a pipeline's stages step on the same batch.
Every rank parses its own environment before any collective, and an unknown `ZEROPP_*` name (a
typo that would otherwise be silently ignored) is an error.
"""

from __future__ import annotations

import difflib
import os
import typing
from collections.abc import Callable, Mapping
from typing import Any

from lightning_zeropp.core.settings.config import ZeroPPConfig

__all__ = [
    "CHECK_BATCH_VAR",
    "CONFIG_VARS",
    "ENV_PREFIX",
    "SPLIT_VAR",
    "check_batch_from_env",
    "config_from_env",
    "describe_env",
    "split_from_env",
    "zeropp_env",
]

ENV_PREFIX = "ZEROPP_"
SPLIT_VAR = "ZEROPP_SPLIT"
CHECK_BATCH_VAR = "ZEROPP_CHECK_BATCH"
_SPLITS = ("auto", "call", "trace", "stack")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _int(var: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{var}={raw!r} is not an integer; set it to a whole number.") from None


def _bool(var: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{var}={raw!r} is not a boolean; use one of {_TRUE + _FALSE}.")


def _bool_or_str(var: str, raw: str) -> bool | str:
    """A boolean, or a named policy (ZEROPP_ACTIVATION_CHECKPOINTING=except_last) for resolve."""
    value = raw.strip().lower()
    return _bool(var, value) if value in _TRUE + _FALSE else value


def _str(var: str, raw: str) -> str:
    return raw.strip()


def _int_list(var: str, raw: str) -> list[int]:
    try:
        return [int(part) for part in raw.replace(" ", "").split(",") if part]
    except ValueError:
        raise ValueError(
            f"{var}={raw!r} is not a comma-separated list of block indices (e.g. {var}=3,6)."
        ) from None


def _bool_str_or_list(var: str, raw: str) -> bool | str | list[int]:
    """A boolean, a named policy, or pipeline ranks (ZEROPP_OFFLOAD_ACTIVATIONS=0,1; one rank
    with a comma, `2,`: a lone 0 or 1 is a boolean)."""
    value = raw.strip().lower()
    if value[:1].isdigit() and value not in _TRUE + _FALSE:
        return _int_list(var, value)
    return _bool_or_str(var, value)


def _parser(hint: Any) -> Callable[[str, str], Any]:
    """How a variable's text becomes a field's value, from the field's type."""
    args = set(typing.get_args(hint)) or {hint}
    args.discard(type(None))
    if list[int] in args and bool in args:
        return _bool_str_or_list
    if list[int] in args:
        return _int_list
    if bool in args:
        return _bool_or_str if str in args else _bool
    if int in args:
        return _int
    return _str  # names and dtypes: resolve checks the words


# ZeroPPConfig field -> parser, read off the fields' types: a new setting gets its variable
# without an edit here.
_PARSERS: dict[str, Callable[[str, str], Any]] = {
    name: _parser(hint) for name, hint in typing.get_type_hints(ZeroPPConfig).items()
}

# Environment variable -> ZeroPPConfig field.
CONFIG_VARS: dict[str, str] = {f"{ENV_PREFIX}{field.upper()}": field for field in _PARSERS}


def zeropp_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The `ZEROPP_*` variables that are set, after checking that every name is known."""
    environ = os.environ if environ is None else environ
    found = {k: v for k, v in environ.items() if k.startswith(ENV_PREFIX)}
    known = [*CONFIG_VARS, SPLIT_VAR, CHECK_BATCH_VAR]
    for name in sorted(found):
        if name not in known:
            upper = f"{ENV_PREFIX}{name[len(ENV_PREFIX) :].upper()}"  # ZEROPP_pp_size
            close = [upper] if upper in known else difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(
                f"unknown environment variable {name}={found[name]!r}; {hint}"
                f"ZeroPP reads only {', '.join(known)}. Rename or unset it."
            )
        if not found[name].strip():
            raise ValueError(f"{name} is set but empty; give it a value or unset it.")
    return found


def config_from_env(environ: Mapping[str, str] | None = None) -> ZeroPPConfig:
    """A `ZeroPPConfig` from the `ZEROPP_*` variables; unset ones keep the config's defaults.

    The result is not resolved yet: sizes left unset are filled in from the world size by
    `ZeroPPConfig.resolve`, which also checks the values against each other.
    """
    values = {
        CONFIG_VARS[var]: _PARSERS[CONFIG_VARS[var]](var, raw)
        for var, raw in zeropp_env(environ).items()
        if var in CONFIG_VARS
    }
    return ZeroPPConfig(**values)


def split_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """`ZEROPP_SPLIT` ("auto", "call", "trace" or "stack"), or None when unset."""
    raw = zeropp_env(environ).get(SPLIT_VAR)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value not in _SPLITS:
        raise ValueError(
            f"{SPLIT_VAR}={raw!r} is unknown; use one of {_SPLITS} (or pass split=<callable> in "
            "code)."
        )
    return value


def check_batch_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """`ZEROPP_CHECK_BATCH`: whether each step checks that a pipeline's stages step on the same
    batch (`core.step.pipeline_batch`); off when unset."""
    raw = zeropp_env(environ).get(CHECK_BATCH_VAR)
    return raw is not None and _bool(CHECK_BATCH_VAR, raw)


def describe_env(environ: Mapping[str, str] | None = None) -> str:
    """`ZEROPP_PP_SIZE=2 (pp_size), ...` for error messages: which variables set which fields."""
    parts = [
        f"{var}={raw} ({CONFIG_VARS.get(var, var[len(ENV_PREFIX) :].lower())})"
        for var, raw in sorted(zeropp_env(environ).items())
    ]
    return ", ".join(parts) if parts else "no ZEROPP_* variables set"
