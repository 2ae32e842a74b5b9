"""lightning_zeropp: ZeroPP (pipeline parallelism over FSDP2) for Lightning and plain torch.

Importing the package registers the Lightning strategy name "zeropp" without importing Lightning:
`lightning_zeropp.core` and `lightning_zeropp.accelerate` must work where Lightning (an extra) is
not installed, and must not pay its import time where it is. `ZeroPPStrategy` is loaded on first
access.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
from typing import TYPE_CHECKING, Any

from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.weights.init_modules import init_weights
from lightning_zeropp.core.weights.materialize import empty_parameters
from lightning_zeropp.fronts.settings import launch_layout

if TYPE_CHECKING:
    from lightning_zeropp.lightning import ZeroPPStrategy, full_parameter, grad_norm, param_norm

__all__ = [
    "ZeroPPConfig",
    "ZeroPPEngine",
    "ZeroPPLayout",
    "ZeroPPStrategy",
    "empty_parameters",
    "full_parameter",
    "grad_norm",
    "init_weights",
    "launch_layout",
    "param_norm",
]

_log = logging.getLogger(__name__)


def __getattr__(name: str) -> Any:  # PEP 562: `lightning_zeropp.ZeroPPStrategy` imports Lightning
    if name in ("ZeroPPStrategy", "full_parameter", "grad_norm", "param_norm"):
        from lightning_zeropp import lightning

        return getattr(lightning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# `Trainer(strategy="zeropp")` looks the name up in Lightning's StrategyRegistry, which only our
# strategy module fills (at its import). Lightning 2.6 offers no lazy or entry-point registration
# for strategies (entry points exist for callbacks only, and are read after the strategy flag is
# checked), so: if Lightning is already imported, import the strategy module now; otherwise a
# one-shot import hook imports it right after `lightning.pytorch` finishes executing, whichever
# way Lightning gets imported later (`import lightning`, `import lightning.pytorch`, ...). It waits
# for all of `lightning.pytorch`, not just `lightning.pytorch.strategies`, because the strategy
# module imports from across it. (`pytorch_lightning` has a registry of its own, which never held
# the name: the strategy subclasses `lightning.pytorch` classes.)
_LIGHTNING = "lightning.pytorch"
_STRATEGY_MODULE = "lightning_zeropp.lightning.strategy"


def _register_strategy() -> None:
    if _STRATEGY_MODULE in sys.modules:
        # Imported already, or being imported (our strategy module is what imports Lightning):
        # the module registers the name at its end.
        return
    try:
        importlib.import_module(_STRATEGY_MODULE)
    except Exception as err:  # never break the user's Lightning import over our name
        _log.warning(
            "lightning_zeropp could not register Trainer(strategy='zeropp'): %s: %s. "
            "`from lightning_zeropp.lightning import ZeroPPStrategy` shows the full error.",
            type(err).__name__,
            err,
        )


class _RunAfterExec:
    """Loader proxy: runs the wrapped loader, puts it back as the module's `__loader__` and
    `__spec__.loader` (no trace of the proxy stays), then registers the strategy name."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, is_package, ...
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
        _register_strategy()


class _RegisterOnLightningImport:
    """`sys.meta_path` finder that answers only for `lightning.pytorch`, once: it finds the real
    spec through the other finders and wraps its loader in `_RunAfterExec`."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _LIGHTNING:
            return None
        with contextlib.suppress(ValueError):  # another thread removed it first
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RunAfterExec(spec.loader)
                return spec
        return None


if sys.modules.get(_LIGHTNING) is not None:
    _register_strategy()
elif not any(isinstance(f, _RegisterOnLightningImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterOnLightningImport())
