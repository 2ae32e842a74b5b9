"""Every private torch name the library uses lives in `core/_torch_private/` (a package, one module
per part of torch it wraps): no other module of `lightning_zeropp/` names one.

Read from each module's syntax tree (docstrings, comments and messages may name private modules):
- an import of a private torch module (`torch.utils._pytree`, `torch._dynamo`) or of a private
  name from a torch module (`from torch.distributed.pipelining.schedules import _Action`);
- an attribute path with a private part under a name bound to torch (`torch._C`,
  `dist._functional_collectives`, `torch.Tensor._make_subclass`, `getattr(torch, "_dynamo")`);
- a private attribute that the package reaches on torch's objects (`_get_fsdp_state`,
  `_compute_loss`, `_version`, ...: read from the package itself, so a name moved in is guarded
  from then on), read or written elsewhere on anything but `self`/`cls` and not defined by the
  library itself.

Not covered: nn.Module's own storage dicts (`_parameters`, `_buffers`,
`_non_persistent_buffers_set`), which `core/split/` and `core/weights/` (and the Lightning front's
network surgery) read as torch's own `nn.Module` code does.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "lightning_zeropp"
PACKAGE = ROOT / "core" / "_torch_private"


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _sources(inside: bool) -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if (PACKAGE in p.parents) == inside)


def _torch_bindings(tree: ast.AST) -> dict[str, str]:
    """Local names bound to torch objects by imports: `dist` -> `torch.distributed`."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    local = alias.asname or alias.name.split(".")[0]
                    bound[local] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _dotted(node: ast.AST) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"], or None when the chain does not start at a name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _string_arg(node: ast.Call) -> str | None:
    """The attribute name of `getattr(x, "name")` / `hasattr` / `setattr`, if a literal."""
    if (
        isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr", "setattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    return None


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def _defined_names(paths: list[Path]) -> set[str]:
    """Names the code in `paths` defines: functions, classes, assigned names, `self.x` attributes."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and _on_self(node)
            ):
                names.add(node.attr)
    return names


def _reached_private_attributes() -> set[str]:
    """Private attributes the package reaches on objects that are not its own."""
    inside = _sources(inside=True)
    reached: set[str] = set()
    for path in inside:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and _private(node.attr) and not _on_self(node):
                reached.add(node.attr)
            elif isinstance(node, ast.Call) and _private(attr := _string_arg(node) or ""):
                reached.add(attr)
    # Names the package defines (its helpers, an override's own state) are not torch's, nor is
    # the state it keeps on torch's objects under the library's prefix (`_lzpp_...`).
    return {n for n in reached - _defined_names(inside) if not n.startswith("_lzpp")}


def private_uses(
    source: str, name: str, torch_attributes: set[str], library_names: set[str]
) -> list[str]:
    """`name:line: what` for each private torch name the module `source` uses."""
    tree = ast.parse(source)
    bound = _torch_bindings(tree)
    found: list[str] = []
    # `torch._C._get_tracing_state` is one use: only the outermost attribute of a chain counts.
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{name}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch" and any(
                    _private(p) for p in alias.name.split(".")
                ):
                    report(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names = [node.module or "", *(a.name for a in node.names)]
            if any(_private(p) for n in names for p in n.split(".")):
                report(node, f"from {node.module} import {', '.join(names[1:])}")
        elif isinstance(node, ast.Attribute):
            parts = _dotted(node)
            if parts is not None and parts[0] in bound and id(node) not in inner:
                full = [*bound[parts[0]].split("."), *parts[1:]]
                if any(_private(p) for p in full):
                    report(node, ".".join(full))
                    continue
            if (
                node.attr in torch_attributes
                and node.attr not in library_names
                and not _on_self(node)
            ):
                report(node, f"attribute {node.attr} (reached in core/_torch_private/)")
        elif isinstance(node, ast.Call) and (attr := _string_arg(node)) and _private(attr):
            call = node.func.id  # type: ignore[attr-defined]
            target = _dotted(node.args[0])
            if target is not None and target[0] in bound:
                report(node, f"{call}({'.'.join(target)}, {attr!r})")
            elif attr in torch_attributes and attr not in library_names:
                report(node, f"{call}(..., {attr!r}) (reached in core/_torch_private/)")
    return found


@pytest.fixture(scope="module")
def guarded_attributes() -> tuple[set[str], set[str]]:
    return _reached_private_attributes(), _defined_names(_sources(inside=False))


def test_private_torch_names_live_in_the_package(
    guarded_attributes: tuple[set[str], set[str]],
) -> None:
    torch_attributes, library_names = guarded_attributes
    outside = _sources(inside=False)
    assert len(outside) > 50 and len(_sources(inside=True)) >= 7  # the scan sees the library
    found = [
        use
        for path in outside
        for use in private_uses(
            path.read_text(), str(path.relative_to(ROOT.parent)), torch_attributes, library_names
        )
    ]
    assert not found, "private torch names outside core/_torch_private/:\n" + "\n".join(found)


def test_the_package_guards_the_attributes_it_reaches(
    guarded_attributes: tuple[set[str], set[str]],
) -> None:
    torch_attributes, _ = guarded_attributes
    # FSDP's state, the schedule's loss hook, c10d's options, autograd's counters.
    assert {"_get_fsdp_state", "_compute_loss", "_device_types", "_version", "_base"} <= (
        torch_attributes
    )


@pytest.mark.parametrize(
    "code",
    [
        "from torch.utils._pytree import tree_map",
        "import torch._dynamo",
        "from torch.distributed.pipelining.schedules import _Action",
        "import torch\nx = torch._C._get_tracing_state()",
        "import torch.distributed as dist\nstore = dist.distributed_c10d._get_default_store()",
        "import torch\nt = torch.Tensor._make_subclass(object, torch.empty(0))",
        "from torch import distributed\ndistributed._functional_collectives",
        "import torch\ngetattr(torch, '_dynamo')",
        "def f(module):\n    return module._get_fsdp_state()",
        "def f(t):\n    return t._version",
    ],
)
def test_each_kind_of_private_use_is_found(
    code: str, guarded_attributes: tuple[set[str], set[str]]
) -> None:
    torch_attributes, library_names = guarded_attributes
    found = private_uses(code, "scratch.py", torch_attributes, library_names)
    assert len(found) == 1, found


def test_public_names_and_own_attributes_pass(
    guarded_attributes: tuple[set[str], set[str]],
) -> None:
    torch_attributes, library_names = guarded_attributes
    code = (
        "import torch\nfrom torch import nn\n"
        "from lightning_zeropp.core._torch_private import tree_map\n"
        "class A:\n    def __init__(self):\n        self._version = 1\n"
        "    def f(self, t):\n        return self._version, torch.__version__, nn.Module\n"
        "'''torch.utils._pytree in a docstring'''\n"
    )
    assert private_uses(code, "scratch.py", torch_attributes, library_names) == []
