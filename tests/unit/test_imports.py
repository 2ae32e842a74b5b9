"""Dependencies by front: the core and the Accelerate front import neither Lightning nor Hydra, yet
`import lightning_zeropp` still makes `Trainer(strategy="zeropp")` work, whichever of the two is
imported first.

Each check runs in a fresh interpreter (this one has imported everything); they all start at once,
as importing Lightning takes seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("lightning", "lightning.pytorch", "pytorch_lightning", "hydra", "omegaconf")
FRONTLESS = [
    "lightning_zeropp",
    "lightning_zeropp.core",
    "lightning_zeropp.accelerate",
    "lightning_zeropp.plan",  # its command line (__main__) imports Hydra only when run
    "lightning_zeropp.transformers",  # last: the only one that imports transformers
]

# The package's frontless modules imported in turn, in one interpreter: after each, what of
# FORBIDDEN (and transformers) it holds. Imports only add modules, so what the first k imports
# leave out, any of them alone leaves out; the first module after which one appears is the one
# that imports it. transformers' own front comes last.
CHECK_IMPORTS = """
import importlib, json, sys
for module in {modules!r}:
    importlib.import_module(module)
    seen = sorted(m for m in {forbidden!r} if m in sys.modules)
    print("IMPORTED", json.dumps([module, seen, "transformers" in sys.modules]))
"""

TRAINER = """
trainer = Trainer(
    strategy="zeropp", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False
)
print("STRATEGY", type(trainer.strategy).__name__)
"""

ORDERS = {
    "zeropp-first": "import lightning_zeropp\nimport lightning\nfrom lightning.pytorch import Trainer",
    "lightning-first": "import lightning\nimport lightning_zeropp\nfrom lightning.pytorch import Trainer",
    "pytorch-only": "import lightning_zeropp\nfrom lightning.pytorch import Trainer",
    # `lightning_zeropp.ZeroPPStrategy` is lazy: the first access imports Lightning (the strategy
    # module itself imports it, under the hook).
    "lazy-attribute": """
import sys
import lightning_zeropp
assert "lightning.pytorch" not in sys.modules
from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.lightning import ZeroPPStrategy as Direct
assert ZeroPPStrategy is Direct and "lightning.pytorch" in sys.modules
from lightning.pytorch import Trainer
""",
}

# Where no front is installed: the core and the Accelerate front still import (`accelerate` is
# left importable here), and only `lightning_zeropp.ZeroPPStrategy` says what is missing.
WITHOUT_FRONTS = """
import sys
for name in ("lightning", "pytorch_lightning", "hydra", "omegaconf", "torchmetrics"):
    sys.modules[name] = None  # what an uninstalled package looks like to `import`
import lightning_zeropp, lightning_zeropp.core, lightning_zeropp.accelerate
try:
    lightning_zeropp.ZeroPPStrategy
except ImportError as err:
    print("LAZY", type(err).__name__, err)
"""

# The fronts' shared room imports no framework: every module of it imports with all of them
# uninstalled (any front may import it, whichever framework that front is for).
FRAMEWORKS = (
    "lightning",
    "pytorch_lightning",
    "accelerate",
    "transformers",
    "trl",
    "hydra",
    "omegaconf",
)
SHARED_ROOM = f"""
import importlib, pkgutil, sys
for name in {FRAMEWORKS!r}:
    sys.modules[name] = None  # what an uninstalled package looks like to `import`
import lightning_zeropp.fronts as room
names = [m.name for m in pkgutil.iter_modules(room.__path__)]
for name in names:
    importlib.import_module("lightning_zeropp.fronts." + name)
print("SHARED", sorted(names))
"""

# Registration failing must not break Lightning's import: a warning names the problem.
FAILED_REGISTRATION = """
import sys
import lightning_zeropp
sys.modules["lightning_zeropp.lightning"] = None  # makes importing the strategy module fail
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
print("REGISTERED", "zeropp" in StrategyRegistry)
"""

SCRIPTS = {
    "imports": CHECK_IMPORTS.format(modules=FRONTLESS, forbidden=FORBIDDEN),
    **{f"order:{k}": code + TRAINER for k, code in ORDERS.items()},
    "without-fronts": WITHOUT_FRONTS,
    "failed-registration": FAILED_REGISTRATION,
    "shared-room": SHARED_ROOM,
}


class Result(NamedTuple):
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


@pytest.fixture(scope="module")
def results() -> dict[str, Result]:
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, code in SCRIPTS.items()
    }
    out = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        out[name] = Result(proc.returncode, stdout, stderr)
    return out


def _imported(results: dict[str, Result]) -> dict[str, tuple[list[str], bool]]:
    """Per frontless module: the FORBIDDEN modules loaded once it (and those before it) were
    imported, and whether transformers was."""
    result = results["imports"]
    assert result.returncode == 0, result.describe()
    lines = [ln.split(" ", 1)[1] for ln in result.stdout.splitlines() if ln.startswith("IMPORTED")]
    return {module: (seen, hf) for module, seen, hf in map(json.loads, lines)}


@pytest.mark.parametrize("module", FRONTLESS)
def test_import_leaves_lightning_and_hydra_out(results: dict[str, Result], module: str) -> None:
    seen, _ = _imported(results)[module]
    assert seen == [], f"`import {module}` (after {FRONTLESS[: FRONTLESS.index(module)]}): {seen}"


@pytest.mark.parametrize("order", ORDERS)
def test_strategy_name_registered(results: dict[str, Result], order: str) -> None:
    result = results[f"order:{order}"]
    assert result.returncode == 0, result.describe()
    assert "STRATEGY ZeroPPStrategy" in result.stdout, result.describe()


def test_core_and_accelerate_front_import_without_lightning(results: dict[str, Result]) -> None:
    result = results["without-fronts"]
    assert result.returncode == 0, result.describe()
    assert "LAZY ModuleNotFoundError" in result.stdout, result.describe()
    assert "could not register" not in result.stderr, result.describe()


def test_shared_room_imports_no_framework(results: dict[str, Result]) -> None:
    result = results["shared-room"]
    assert result.returncode == 0, result.describe()
    assert "SHARED [" in result.stdout and "'optim'" in result.stdout, result.describe()


def test_failed_registration_does_not_break_lightning(results: dict[str, Result]) -> None:
    result = results["failed-registration"]
    assert result.returncode == 0, result.describe()
    assert "REGISTERED False" in result.stdout, result.describe()
    assert "could not register Trainer(strategy='zeropp')" in result.stderr, result.describe()


def test_transformers_imported_by_its_front_only(results: dict[str, Result]) -> None:
    imported = _imported(results)
    for module in FRONTLESS[: FRONTLESS.index("lightning_zeropp.transformers")]:
        assert not imported[module][1], f"`import {module}` imported transformers"
    # Nothing outside the front imports it (it may import the Accelerate front and the core),
    # but the TRL front, built on it as it is built on the Accelerate front (TRL's trainers are
    # transformers' Trainer).
    front = ROOT / "lightning_zeropp" / "transformers"
    trl = ROOT / "lightning_zeropp" / "trl"
    for path in (ROOT / "lightning_zeropp").rglob("*.py"):
        if front not in path.parents and trl not in path.parents:
            assert "lightning_zeropp.transformers" not in path.read_text(), path


def test_core_dependencies_are_torch_only() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [req.split(";")[0].strip().lower() for req in project["dependencies"]]
    for banned in ("lightning", "pytorch-lightning", "torchmetrics", "hydra", "omegaconf"):
        assert not [n for n in names if n.startswith(banned)], (banned, names)
    assert any(n.startswith("torch>=") for n in names), names
    extras = project["optional-dependencies"]
    assert any(r.startswith("lightning>=") for r in extras["lightning"])
    assert any(r.startswith("hydra-core") for r in extras["hydra"])
    # The tests need every front: `dev` pulls them all through `lightning-zeropp[...]`.
    (self_ref,) = [r for r in extras["dev"] if r.startswith("lightning-zeropp[")]
    pulled = self_ref.split("[", 1)[1].split("]", 1)[0].split(",")
    for extra in ("lightning", "accelerate", "hf", "viz", "hydra"):
        assert extra in pulled, (extra, extras["dev"])
