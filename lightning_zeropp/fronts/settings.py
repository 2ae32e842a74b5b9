"""One settings path for every front: code arguments over `ZEROPP_*` variables over defaults,
resolved once, at the front's door.

`merge_settings(given, split=...)` is the only place a front combines what the user wrote in code
(`ZeroPPStrategy(pp_size=2)`, `ZeroPPPlugin(schedule="zeropp")`, `prepare_pipeline(config=...)`)
with what the launcher carries in the environment (`ZEROPP_*`, see `core.settings.env`, and the
launcher's `LOCAL_WORLD_SIZE`). One precedence: a setting given in code wins, one left out (None)
takes its variable, else `ZeroPPConfig`'s default; the split method likewise (`split=` in code,
then `ZEROPP_SPLIT`, then "auto"). `RunSettings.resolve(world_size)` resolves the result and, when
a bad value came from a variable, says which variable set it: the user never wrote it in code.

Below a front's door only a resolved `ZeroPPLayout` passes: the core reads no launcher variable.
`launch_layout(config)` is that door for plain PyTorch (a config resolved for the launched world
and the launcher's ranks per node), what `ZeroPPEngine` takes.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lightning_zeropp.core.settings import env
from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.settings.values import fields_of, setting_error

__all__ = [
    "FIELDS",
    "RunSettings",
    "check_names",
    "launch_layout",
    "launcher_node_size",
    "merge_settings",
    "takes_settings",
]

FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ZeroPPConfig))


@dataclass(frozen=True)
class RunSettings:
    """What a front will run with, before the world size is known.

    `config`: the merged settings; `split`: the split method (a name or a callable); `from_env`:
    field -> the variable that set it (`"ZEROPP_PP_SIZE=2"`); `ignored`: variables set but
    overridden by a whole config given in code; `node_size`: the launcher's ranks per node.
    """

    config: ZeroPPConfig
    split: Any = "auto"
    from_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    node_size: int | None = None

    def resolve(self, world_size: int) -> ZeroPPLayout:
        """The layout for `world_size` processes; a bad value set by a variable names it."""
        try:
            return self.config.resolve(world_size, self.node_size)
        except ValueError as err:
            named = [f"{self.from_env[f]} ({f})" for f in fields_of(err) if f in self.from_env]
            if not named:
                raise
            raise setting_error(
                fields_of(err), f"{err} (settings from the environment: {', '.join(named)})"
            ) from err

    def describe_env(self) -> str:
        """The variables that set settings, for messages ("" when none did)."""
        return ", ".join(self.from_env.values())


def merge_settings(
    given: Mapping[str, Any] | ZeroPPConfig | ZeroPPLayout | None = None,
    *,
    split: Any = None,
    owner: str = "settings",
    environ: Mapping[str, str] | None = None,
) -> RunSettings:
    """Merge code arguments over the `ZEROPP_*` variables (see the module docstring).

    `given`: `ZeroPPConfig` field -> value (None: not given), or a whole `ZeroPPConfig` (or a
    resolved `ZeroPPLayout`), every field of which counts as given (the variables are then ignored and listed in `ignored`).
    `owner` names the caller in the error for an unknown setting.
    """
    environ = os.environ if environ is None else environ
    if isinstance(given, ZeroPPLayout):  # resolved already: a whole config, every field decided
        given = ZeroPPConfig(**given.settings())
    found = env.zeropp_env(environ)  # unknown or empty ZEROPP_* names fail here, on every rank
    variables = {field: var for var, field in env.CONFIG_VARS.items() if var in found}
    if isinstance(given, ZeroPPConfig):
        config, from_env = given, {}
        ignored = tuple(sorted(variables.values()))
    else:
        values = {k: v for k, v in (given or {}).items() if v is not None}
        check_names(values, owner)
        from_env = {
            field: f"{var}={found[var]}" for field, var in variables.items() if field not in values
        }
        base = env.config_from_env(environ) if from_env else ZeroPPConfig()
        keep = {f: getattr(base, f) for f in from_env}
        config, ignored = ZeroPPConfig(**keep, **values), ()
    chosen = split if split is not None else (env.split_from_env(environ) or "auto")
    if split is None and env.SPLIT_VAR in found:
        from_env = {**from_env, "split": f"{env.SPLIT_VAR}={found[env.SPLIT_VAR]}"}
    return RunSettings(config, chosen, from_env, ignored, launcher_node_size(environ))


def check_names(settings: Mapping[str, Any], owner: str) -> None:
    """Refuse a setting that is no `ZeroPPConfig` field, naming the closest one."""
    unknown = sorted(set(settings) - set(FIELDS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], FIELDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(
            f"{owner} got unknown setting {unknown[0]!r}{hint}; settings are ZeroPPConfig's "
            f"fields: {', '.join(FIELDS)}."
        )


def launcher_node_size(environ: Mapping[str, str] | None = None) -> int | None:
    """Ranks per node as the launcher says (torchrun's and Lightning's `LOCAL_WORLD_SIZE`; under
    `srun`, which sets no such variable, SLURM's `SLURM_NTASKS_PER_NODE`)."""
    environ = os.environ if environ is None else environ
    name = "LOCAL_WORLD_SIZE"
    if not environ.get(name) and environ.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        name = "SLURM_NTASKS_PER_NODE"
    raw = environ.get(name)
    try:
        return int(raw) if raw else None
    except ValueError:
        raise ValueError(
            f"{name}={raw!r} is not an integer; the launcher sets it to the processes "
            "per node (unset it, or set node_size=...)."
        ) from None


def launch_layout(
    config: ZeroPPConfig | ZeroPPLayout, world_size: int | None = None
) -> ZeroPPLayout:
    """`config` resolved for this launch: `world_size` processes (default: the default process
    group's, which must be initialized), as many per node as the launcher says
    (`LOCAL_WORLD_SIZE`, see `launcher_node_size`; `config.node_size` wins when set). A layout is
    checked against the world and returned as it is. What plain-PyTorch code gives
    `ZeroPPEngine`: `ZeroPPEngine(model, launch_layout(ZeroPPConfig(pp_size=2)), ...)`."""
    if world_size is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "launch_layout(config) resolves the config for the launched world, but no "
                "process group is initialized: call torch.distributed.init_process_group() "
                "first (under torchrun), or pass world_size=..."
            )
        world_size = dist.get_world_size()
    if isinstance(config, ZeroPPLayout):  # its node size was decided when it was resolved
        return config.resolve(world_size)
    return config.resolve(world_size, launcher_node_size())


def takes_settings(init: Callable[..., None]) -> Callable[..., None]:
    """Show `ZeroPPConfig`'s fields in the signature of an `__init__(..., **settings)` (for
    `help()`, IDEs and signature-reading tools): the fields stay the one list of settings."""
    sig = inspect.signature(init)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    # Types, not the strings the dataclass holds under postponed annotations: tools read the
    # signature without resolving them (jsonargparse before 4.53 skipped every field, so
    # LightningCLI refused `--trainer.strategy.pp_size=2`). None: not given.
    hints = typing.get_type_hints(ZeroPPConfig)
    params += [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=typing.Optional[hints[f.name]],  # noqa: UP045 - a runtime value
        )
        for f in dataclasses.fields(ZeroPPConfig)
    ]
    init.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return init
