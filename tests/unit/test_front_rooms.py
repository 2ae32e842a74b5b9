"""The rooms' import arrows, read from the source: no front imports another front (except the
layering the fronts are built on: the Trainer front builds on the Accelerate front, TRL's on the
Trainer's), and nothing below the fronts (the core, the planner, the bundled models, and the
fronts' shared room `fronts/`) imports any; the core does not import the shared room either.

`test_imports.py` checks what importing a module pulls in at run time; this reads every import
statement, including those inside functions, which run-time checks only see when they run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_zeropp"
FRONTS = ("lightning", "accelerate", "transformers", "trl")
# What the fronts share (`lightning_zeropp/fronts/`): any front may import it, it imports no
# front (it is not in FRONTS, so it may import none), and the core, below it, does not import it.
SHARED = "fronts"
# front -> the fronts it may import (what it is built on).
BUILT_ON = {
    "lightning": set(),
    "accelerate": set(),
    "transformers": {"accelerate"},
    "trl": {"transformers", "accelerate"},
}


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """Every `lightning_zeropp...` module the file imports, relative imports made absolute."""
    package = ["lightning_zeropp", *path.relative_to(root).parts[:-1]]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            # `from lightning_zeropp import accelerate` names a front as an attribute.
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == "lightning_zeropp"]


def front_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FRONTS else None


def crossings(files: list[Path], root: Path = PACKAGE) -> list[str]:
    """`root` is the package's folder; a file's room is its first folder below it."""
    bad = []
    for path in files:
        rel = path.relative_to(root).parts
        room = rel[0] if len(rel) > 1 else path.stem
        allowed = BUILT_ON.get(room, set()) | ({room} if room in FRONTS else set())
        for line, name in imported_modules(path, root):
            front = front_of(name)
            shared = room == "core" and name.split(".")[1:2] == [SHARED]
            if (front is not None and front not in allowed) or shared:
                bad.append(f"lightning_zeropp/{'/'.join(rel)}:{line} imports {name}")
    return bad


def library_files() -> list[Path]:
    # The package's own __init__ offers `ZeroPPStrategy` lazily (test_imports.py checks that it
    # imports no front when loaded); it is the one file above every room.
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p != PACKAGE / "__init__.py"]


def test_no_room_imports_a_front_it_is_not_built_on() -> None:
    assert crossings(library_files()) == []


@pytest.mark.parametrize(
    ("room", "line", "crosses"),
    [
        ("lightning", "from lightning_zeropp.accelerate.engine import x", True),
        ("accelerate", "from ..transformers import trainer", True),
        ("core/step", "from ...lightning.steps import x", True),
        ("models", "import lightning_zeropp.transformers.trainer", True),
        ("plan", "from lightning_zeropp import lightning", True),
        ("fronts", "from lightning_zeropp.accelerate.optim import x", True),
        ("fronts", "from ..lightning import strategy", True),
        ("core/split", "from lightning_zeropp.fronts.call_adapter import x", True),
        ("core/step", "from ...fronts import loader", True),
        ("fronts", "from ..core.step.chunked_loss import x", False),
        ("lightning", "from lightning_zeropp.fronts.loader import x", False),
        ("accelerate", "from ..fronts.optim import x", False),
        ("transformers", "from ..accelerate.engine import x", False),
        ("trl", "from lightning_zeropp.transformers.trainer import x", False),
        ("core/step", "from ..mesh import x", False),
    ],
)
def test_the_check_sees_a_crossing(tmp_path: Path, room: str, line: str, crosses: bool) -> None:
    # The check must be able to fail: a package holding one file in the room, with that import.
    path = tmp_path / room / "probe.py"
    path.parent.mkdir(parents=True)
    path.write_text(line + "\n")
    assert bool(crossings([path], root=tmp_path)) == crosses
