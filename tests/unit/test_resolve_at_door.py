"""Settings are resolved once, at a front's door: below it only a `ZeroPPLayout` passes.

`ZeroPPEngine` resolves nothing and reads no launcher variable (`LOCAL_WORLD_SIZE`, SLURM's
`SLURM_NTASKS_PER_NODE`); an unresolved `ZeroPPConfig` is refused naming the helper that resolves
it, `launch_layout`, which is where plain-PyTorch code reads the launcher's ranks per node.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_zeropp import ZeroPPConfig, ZeroPPLayout, launch_layout

CORE = Path(__file__).resolve().parents[2] / "lightning_zeropp" / "core"
LAUNCHER_VARIABLES = {"LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "LOCAL_RANK"}


def test_no_core_module_names_a_launcher_variable():
    """Reading one needs its name as a string of its own (`environ["LOCAL_WORLD_SIZE"]`); the
    core only mentions them inside longer messages."""
    found = []
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in LAUNCHER_VARIABLES:
                found.append(f"{path.relative_to(CORE.parent)}:{node.lineno} {node.value}")
    assert not found, f"the core reads launcher variables (the fronts' job): {found}"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3))


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


@pytest.mark.usefixtures("group", "one_thread")
def test_the_engine_refuses_a_config_naming_launch_layout():
    from lightning_zeropp.core.engine import ZeroPPEngine

    with pytest.raises(TypeError, match=r"takes a resolved ZeroPPLayout, got ZeroPPConfig.*"):
        ZeroPPEngine(_model(), ZeroPPConfig(num_microbatches=1), loss_fn=_mse)
    with pytest.raises(TypeError, match=r"lightning_zeropp\.launch_layout\(config\)"):
        ZeroPPEngine(_model(), ZeroPPConfig(num_microbatches=1), loss_fn=_mse)


@pytest.mark.usefixtures("group", "one_thread")
def test_the_engine_reads_no_launcher_variable(monkeypatch):
    """A launcher variable the engine would fail to read (not a number) is not read: the layout
    says the node size, and the step trains as one process does."""
    from lightning_zeropp.core.engine import ZeroPPEngine

    layout = ZeroPPConfig(num_microbatches=1).resolve(1, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not-a-number")
    model, reference = _model(), _model()
    engine = ZeroPPEngine(model, layout, loss_fn=_mse)
    assert engine.config is layout
    x, y = torch.randn(4, 4), torch.randn(4, 3)
    loss = engine.train_step(x, target=y)
    torch.testing.assert_close(loss.float(), _mse(reference(x), y).detach(), atol=1e-5, rtol=0)


@pytest.mark.usefixtures("group")
def test_launch_layout_reads_the_launcher(monkeypatch):
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    layout = launch_layout(ZeroPPConfig(pp_size=1), world_size=4)
    assert isinstance(layout, ZeroPPLayout) and layout.node_size == 2
    assert launch_layout(ZeroPPConfig(pp_size=1, node_size=4), world_size=4).node_size == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    here = launch_layout(ZeroPPConfig())  # the process group's world: one rank
    assert (here.world_size, here.node_size) == (1, 1)
    assert launch_layout(here) is here  # a layout passes as it is, checked against the world
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE='x' is not an integer"):
        launch_layout(ZeroPPConfig())
