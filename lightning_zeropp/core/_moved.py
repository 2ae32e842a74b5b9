"""Old import paths of the core's modules, from before it was arranged in rooms.

`lightning_zeropp.core.config`, `...core.failure`, `...core.export` and the rest were flat files;
they now live in folders by concern (`settings/`, `schedule/`, `shard/`, `split/`, `step/`,
`measure/`, `weights/`). Code written against the old paths keeps working: importing one gives
the module at its new path (the same module object, so patches and `isinstance` agree), with a
`DeprecationWarning` naming the new path. `schedule`, `shard` and `split` became folders of the
same name, which re-export what the file held.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

__all__ = ["MOVED", "install"]

_CORE = "lightning_zeropp.core"

# old module name under core -> its new path under core
MOVED: dict[str, str] = {
    "config": "settings.config",
    "placement": "settings.placement",
    "plus_settings": "settings.plus",
    "env": "settings.env",
    "zeropp_schedule": "schedule.zeropp",
    "runtime": "schedule.runtime",
    "plus": "shard.plus",
    "plus_comm": "shard.plus_comm",
    "quant": "shard.quant",
    "call_split": "split.call_plan",
    "call_stages": "split.call_stages",
    "call_tags": "split.tags",
    "chain": "split.chain",
    "tied": "split.tied",
    "modules": "split.modules",
    "call_adapter": "split.call_adapter",
    "batch": "step.batch",
    "grads": "step.grads",
    "nonfinite": "step.nonfinite",
    "failure": "step.failure",
    "comm": "measure.comm",
    "traffic": "measure.traffic",
    "timeline": "measure.timeline",
    "memory": "measure.memory",
    "layout": "measure.layout",
    "materialize": "weights.materialize",
    "load": "weights.load",
    "checkpoint": "weights.checkpoint",
    "async_checkpoint": "weights.async_checkpoint",
    "commit": "weights.commit",
    "export": "weights.export",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `lightning_zeropp.core.<old>` and loads it as the module at its new path."""

    def find_spec(self, fullname: str, path: object, target: object = None):  # type: ignore[override]
        old = fullname.removeprefix(f"{_CORE}.")
        if old == fullname or old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = f"{_CORE}.{MOVED[spec.name.removeprefix(f'{_CORE}.')]}"
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there.", DeprecationWarning, stacklevel=2
        )
        return importlib.import_module(new)

    def exec_module(self, module: types.ModuleType) -> None:
        pass  # the module at its new path has run already


def install() -> None:
    """Put the finder on `sys.meta_path` once (importing the core does)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
