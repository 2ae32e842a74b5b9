"""The settings of `ZeroPPStrategy`: its keyword arguments merged over the `ZEROPP_*` variables.

The strategy's settings take the one path every front takes (`fronts.settings`): arguments
given in code over the `ZEROPP_*` variables over `ZeroPPConfig`'s defaults; the layout is resolved
at setup, when the world size is known. Checked at construction, on every rank.
"""

from __future__ import annotations

from typing import Any

from lightning_zeropp.core.split.methods import SplitMethod, check_split
from lightning_zeropp.fronts.settings import RunSettings, merge_settings

__all__ = ["strategy_settings"]


def strategy_settings(settings: dict[str, Any], split: SplitMethod | None) -> RunSettings:
    """`ZeroPPStrategy(split=..., **settings)` over the `ZEROPP_*` variables, checked."""
    if split is not None:
        check_split(split)
    merged = merge_settings(settings, split=split, owner="ZeroPPStrategy")
    check_split(merged.split)
    return merged
