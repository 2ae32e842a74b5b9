"""ZEROPP_* variables under a Trainer that is not ZeroPP's: refused, never silently DDP.

A launcher setting `ZEROPP_PP_SIZE=2` over an unchanged `transformers.Trainer` script (TRL's
`SFTTrainer`, `DPOTrainer`, ... are such Trainers) would train as plain DDP: the script never
imports lightning_zeropp, so nothing reads the variables. This module is run at every Python
start-up by `lightning_zeropp_guard.pth` (installed with the package), which imports it only when
a `ZEROPP_*` variable is set; then `transformers.Trainer.__init__` is wrapped, as soon as
`transformers.trainer` is imported, to raise on every rank at construction (before any
collective) for a Trainer that is not `ZeroPPTrainer` or one of its subclasses. Standard library
only, and nothing is imported that the script does not import itself (not torch, transformers or
trl): start-up stays as fast.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any

__all__ = ["install", "message", "zeropp_variables"]

_TARGET = "transformers.trainer"
_MARK = "_zeropp_trainer"  # a class attribute ZeroPPTrainer sets to True
# TRL trainers lightning_zeropp.trl has a ZeroPP class for
_TRL_PIPELINED = ("SFTTrainer", "RewardTrainer", "DPOTrainer")


def zeropp_variables() -> dict[str, str]:
    """The `ZEROPP_*` variables set (non-empty) in this process's environment."""
    return {k: v for k, v in os.environ.items() if k.startswith("ZEROPP_") and v}


def message(trainer_cls: type, variables: dict[str, str]) -> str:
    """The error for `trainer_cls` constructed with `variables` set."""
    shown = ", ".join(f"{k}={v}" for k, v in sorted(variables.items()))
    origin = trainer_cls.__module__.split(".")[0]
    name = f"{trainer_cls.__name__} ({origin})"
    if origin == "trl" and trainer_cls.__name__ in _TRL_PIPELINED:
        fix = (
            f"import ZeroPP{trainer_cls.__name__} from lightning_zeropp.trl (TRL's arguments "
            "plus zeropp_plugin)"
        )
    elif origin == "trl":
        fix = (
            f"note that TRL's {trainer_cls.__name__} has no ZeroPP class yet (lightning_zeropp.trl "
            f"has {', '.join('ZeroPP' + n for n in _TRL_PIPELINED)})"
        )
    else:
        fix = "use lightning_zeropp.transformers.ZeroPPTrainer (the Trainer's arguments plus zeropp_plugin)"
    return (
        f"{shown} {'is' if len(variables) == 1 else 'are'} set, but {name} is transformers' "
        "Trainer without ZeroPP: it would train as plain data parallelism, ignoring them. To "
        f"pipeline it, {fix}; to run it as it is, unset the ZEROPP_* variables."
    )


def _guard(module: Any) -> None:
    """Wrap `module.Trainer.__init__` (once) to refuse a Trainer that is not ZeroPP's."""
    trainer = getattr(module, "Trainer", None)
    if trainer is None or getattr(trainer.__init__, "_zeropp_guarded", False):
        return
    original = trainer.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        variables = zeropp_variables()
        if variables and not getattr(type(self), _MARK, False):
            raise ValueError(message(type(self), variables))
        original(self, *args, **kwargs)

    __init__._zeropp_guarded = True  # type: ignore[attr-defined]
    trainer.__init__ = __init__


class _GuardAfterExec:
    """Loader proxy: runs the real loader, puts it back on the module, then wraps the Trainer."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            module.__loader__ = self._loader
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self._loader
        _guard(module)


class _GuardOnImport:
    """`sys.meta_path` finder answering only for `transformers.trainer`, once."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _GuardAfterExec(spec.loader)
                return spec
        return None


def install() -> None:
    """Guard `transformers.Trainer` now if it is imported, else when it is."""
    if not zeropp_variables():
        return
    if sys.modules.get(_TARGET) is not None:
        _guard(sys.modules[_TARGET])
    elif not any(isinstance(f, _GuardOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _GuardOnImport())
