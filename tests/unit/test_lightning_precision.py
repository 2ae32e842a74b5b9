"""The Lightning precision plugin stands on what it is given: a `HeldGradients` (a step's
gradients until backward, and the engine whose global norm clipping uses). It imports no
strategy and calls none: here it runs with no strategy at all."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("lightning")

from lightning_zeropp.core.step.grads import StepGrads  # noqa: E402
from lightning_zeropp.lightning import precision  # noqa: E402
from lightning_zeropp.lightning.precision import HeldGradients, ZeroPPPrecision  # noqa: E402


def test_precision_module_imports_no_strategy() -> None:
    source = Path(precision.__file__).read_text()
    imported: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            imported += [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            imported += [a.name for a in node.names]
    assert not [m for m in imported if "strateg" in m.lower()], imported
    # nor reaches one: no attribute or name of the strategy's in its code
    names = [n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)]
    names += [n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)]
    assert not [n for n in names if "strateg" in n.lower()], names


class _Engine:
    def __init__(self) -> None:
        self.norms: list[float] = []

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        self.norms.append(max_norm)
        return torch.tensor(0.0)


def _module(accumulate: int) -> Any:
    return SimpleNamespace(trainer=SimpleNamespace(accumulate_grad_batches=accumulate))


def test_backward_releases_held_gradients_as_lightnings_mean() -> None:
    param = nn.Parameter(torch.zeros(3))
    param.grad = torch.full((3,), 6.0)
    held = HeldGradients()
    held.hold(StepGrads([param]), 0.5)
    assert param.grad is None  # set aside until Lightning's backward
    plugin = ZeroPPPrecision(held)
    plugin.backward(torch.tensor(1.0), _module(accumulate=3))
    assert param.grad is not None
    torch.testing.assert_close(param.grad, torch.full((3,), 6.0 * 0.5 / 3))
    plugin.backward(torch.tensor(1.0), _module(accumulate=3))  # nothing held: nothing added
    torch.testing.assert_close(param.grad, torch.full((3,), 1.0))


def test_clipping_uses_the_given_engine() -> None:
    held = HeldGradients()
    plugin = ZeroPPPrecision(held)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(RuntimeError, match="only after the strategy's setup"):
        plugin.clip_grad_by_norm(optimizer, 1.0)
    engine = _Engine()
    held.engine = engine
    plugin.clip_grad_by_norm(optimizer, 0.25)
    assert engine.norms == [0.25]
