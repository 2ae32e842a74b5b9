"""Every private `transformers.Trainer` name the library overrides or reaches lives in
`lightning_zeropp/transformers/_private.py`, which checks each on the installed transformers at
import (the sibling of `test_private_names.py`, which does this for torch).

The Trainer's private names are read from transformers itself: the Trainer's private attributes
(its methods, inherited ones included) and the private attributes its own code sets on `self`
(`_created_lr_scheduler`). Outside the guarded module, no module of `lightning_zeropp/` may
define a method of that name in a class (an override), reach one as an attribute (on `self` or
anything else: `super()._init_training_state`, `trainer._get_output_dir`), name one in
`getattr`/`hasattr`/`setattr`, or import a private name or module of transformers. TRL's own
private names (`_metrics`) are allowed in `lightning_zeropp/trl/` only, behind `trl.CHECKED`.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from transformers import Trainer  # noqa: E402

from lightning_zeropp.transformers import _private  # noqa: E402

ROOT = Path(__file__).resolve().parents[2] / "lightning_zeropp"
GUARDED = ROOT / "transformers" / "_private.py"
TRL_ROOM = ROOT / "trl"


def _private_name(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_names_of(cls: type) -> set[str]:
    """`cls`'s private attributes, and those the code of each class in its MRO sets on `self`."""
    names = {n for n in dir(cls) if _private_name(n)}
    for klass in cls.__mro__:
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(inspect.cleandoc("\n" + source))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and isinstance(node.ctx, ast.Store)
                and _private_name(node.attr)
            ):
                names.add(node.attr)
    return names


@pytest.fixture(scope="module")
def trainer_names() -> set[str]:
    return _private_names_of(Trainer)


def private_trainer_uses(source: str, name: str, names: set[str]) -> list[str]:
    """`name:line: what` for each private Trainer name (in `names`) the module `source` uses."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        what = None
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name in names:
                    found.append(f"{name}:{item.lineno}: overrides {node.name}.{item.name}")
        elif isinstance(node, ast.Attribute) and node.attr in names:
            what = f"attribute {node.attr}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in names
        ):
            what = f"{node.func.id}(..., {node.args[1].value!r})"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
            "transformers"
        ):
            parts = [*(node.module or "").split("."), *(a.name for a in node.names)]
            if any(_private_name(p) for p in parts):
                what = f"from {node.module} import {', '.join(a.name for a in node.names)}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "transformers" and any(_private_name(p) for p in parts):
                    what = f"import {alias.name}"
        if what is not None:
            found.append(f"{name}:{node.lineno}: {what}")  # type: ignore[attr-defined]
    return found


def test_private_trainer_names_live_in_the_guarded_module(trainer_names: set[str]) -> None:
    # the names the front is known to use are among those read from transformers
    assert {"_save_checkpoint", "_get_num_items_in_batch", "_created_lr_scheduler"} <= trainer_names
    outside = sorted(p for p in ROOT.rglob("*.py") if p != GUARDED)
    assert len(outside) > 50  # the scan sees the library
    found = [
        use
        for path in outside
        for use in private_trainer_uses(
            path.read_text(), str(path.relative_to(ROOT.parent)), trainer_names
        )
    ]
    assert not found, (
        "private transformers.Trainer names outside lightning_zeropp/transformers/_private.py "
        "(name them there, in OVERRIDDEN or REACHED, and reach them through it):\n"
        + "\n".join(found)
    )


def _imports_trainers(source: str) -> bool:
    return any(
        (node.module or "").split(".")[0] in ("transformers", "trl")
        if isinstance(node, ast.ImportFrom)
        else any(a.name.split(".")[0] in ("transformers", "trl") for a in node.names)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import | ast.ImportFrom)
    )


def test_private_trl_names_stay_in_the_trl_room() -> None:
    trl = pytest.importorskip("trl")
    names = _private_names_of(trl.SFTTrainer) - _private_names_of(Trainer)
    assert "_metrics" in names
    # modules working with trainers (the library's own `_metrics` elsewhere is not TRL's)
    outside = sorted(
        p
        for p in ROOT.rglob("*.py")
        if TRL_ROOM not in p.parents and _imports_trainers(p.read_text())
    )
    assert len(outside) >= 5  # the transformers front at least
    found = [
        use
        for path in outside
        for use in private_trainer_uses(path.read_text(), str(path.relative_to(ROOT)), names)
    ]
    assert not found, "private TRL names outside lightning_zeropp/trl/:\n" + "\n".join(found)


def test_the_guarded_module_names_every_private_name_it_reaches(trainer_names: set[str]) -> None:
    """What `_private.py` reaches is what it checks at import: nothing goes unchecked."""
    checked = set(_private.OVERRIDDEN) | set(_private.REACHED)
    used = {
        use.split(" ")[-1].strip("'()").split(".")[-1]
        for use in private_trainer_uses(GUARDED.read_text(), "_private.py", trainer_names)
    }
    overridden = {
        n for n in vars(_private.TrainerOverrides) if _private_name(n) and n in trainer_names
    }
    assert overridden == set(_private.OVERRIDDEN)
    assert used - checked == set()
    assert checked <= trainer_names


@pytest.mark.parametrize(
    "code",
    [
        "class T(Trainer):\n    def _save_checkpoint(self, model, trial):\n        pass",
        "def f(trainer):\n    return trainer._get_output_dir(trial=None)",
        "class T(Trainer):\n    def f(self):\n        return super()._init_training_state(1)",
        "def f(trainer):\n    trainer._created_lr_scheduler = False",
        "def f(trainer):\n    return getattr(trainer, '_loss_shifts_labels', False)",
        "from transformers.trainer import _is_peft_model",
        "import transformers.models.auto._private_thing",
    ],
)
def test_each_kind_of_private_trainer_use_is_found(code: str, trainer_names: set[str]) -> None:
    assert len(private_trainer_uses(code, "scratch.py", trainer_names)) == 1


def test_public_names_and_own_private_names_pass(trainer_names: set[str]) -> None:
    code = (
        "from transformers import Trainer\n"
        "class T(Trainer):\n"
        "    def _zeropp_save_checkpoint(self, model, trial):\n        self._pipeline = None\n"
        "    def compute_loss(self, *a):\n        return super().compute_loss(*a)\n"
        "'''Trainer._save_checkpoint in a docstring'''\n"
    )
    assert private_trainer_uses(code, "scratch.py", trainer_names) == []


def test_a_missing_private_method_is_refused_naming_it_and_the_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _private.require_checked_trainer()  # the installed release passes
    monkeypatch.delattr(Trainer, "_save_rng_state")
    with pytest.raises(ImportError) as err:
        _private.require_checked_trainer()
    message = str(err.value)
    assert "Trainer._save_rng_state is missing" in message
    assert f"transformers {transformers.__version__} is installed" in message
    assert ">=5.17,<6" in message and 'pip install "transformers>=5.17,<6"' in message


def test_a_changed_signature_is_refused_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Trainer, "_get_output_dir", lambda self, trial, run_name: "")
    with pytest.raises(ImportError, match=r"Trainer\._get_output_dir takes \(trial, run_name\), "):
        _private.require_checked_trainer()
