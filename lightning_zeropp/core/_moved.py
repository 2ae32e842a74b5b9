"""Old import paths of the core's modules, from before it was arranged in rooms.

`lightning_zeropp.core.config`, `...core.failure`, `...core.export` and the rest were flat files;
they now live in folders by concern (`settings/`, `schedule/`, `shard/`, `split/`, `step/`,
`measure/`, `weights/`). Code written against the old paths keeps working: importing one gives
the module at its new path (the same module object, so patches and `isinstance` agree), with a
`DeprecationWarning` naming the new path. `schedule`, `shard` and `split` became folders of the
same name, which re-export what the file held.

The same mechanism serves any package whose modules moved: `install(package, moved)` puts one
finder per package on `sys.meta_path` (the fronts install theirs, naming their own old files, when
they are imported: a front's old path imports its package first). `TABLES` holds every package's
table, for the tests.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Mapping

__all__ = ["MOVED", "TABLES", "install"]

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


# package -> (old module name under it -> its new path under it), for every installed finder
TABLES: dict[str, Mapping[str, str]] = {}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `<package>.<old>` and loads it as the module at its new path."""

    def __init__(self, package: str, moved: Mapping[str, str]) -> None:
        self.package, self.moved = package, moved

    def _new(self, fullname: str) -> str | None:
        old = fullname.removeprefix(f"{self.package}.")
        if old == fullname or old not in self.moved:
            return None
        return f"{self.package}.{self.moved[old]}"

    def find_spec(self, fullname: str, path: object, target: object = None):  # type: ignore[override]
        if self._new(fullname) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = self._new(spec.name)
        assert new is not None
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there.", DeprecationWarning, stacklevel=2
        )
        module = importlib.import_module(new)
        # The import system sets `__spec__` on what this returns: keep the module's own.
        spec._moved_own_spec = module.__spec__  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The module at its new path has run already; give it back its own spec.
        own = getattr(module.__spec__, "_moved_own_spec", None)
        if own is not None:
            module.__spec__ = own


def install(package: str = _CORE, moved: Mapping[str, str] = MOVED) -> None:
    """Put `package`'s finder on `sys.meta_path` once (importing the package does)."""
    TABLES[package] = moved
    if not any(isinstance(f, _Alias) and f.package == package for f in sys.meta_path):
        sys.meta_path.append(_Alias(package, moved))
