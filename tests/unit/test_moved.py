"""Old import paths still import, as the same module objects, with a warning that names the new
path: the core's flat files (before its rooms) and the fronts' files renamed to the names both
fronts share; and no module of the library imports an old path itself."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import warnings

import lightning_zeropp
from lightning_zeropp.core._moved import MOVED, TABLES

# What users may have written against the fronts before they shared file names: old -> new.
FRONTS_MOVED = {
    "lightning_zeropp.accelerate.zeropp_plugin": "lightning_zeropp.accelerate.settings",
    "lightning_zeropp.accelerate.plugin": "lightning_zeropp.accelerate.build",
    "lightning_zeropp.accelerate.pipeline_model": "lightning_zeropp.accelerate.steps",
    "lightning_zeropp.lightning.resume": "lightning_zeropp.lightning.data",
    "lightning_zeropp.transformers.checkpoint": "lightning_zeropp.transformers.checkpointing",
}


def test_every_old_path_is_the_module_at_its_new_path() -> None:
    for old, new in MOVED.items():
        module = importlib.import_module(f"lightning_zeropp.core.{new}")
        sys.modules.pop(f"lightning_zeropp.core.{old}", None)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            alias = importlib.import_module(f"lightning_zeropp.core.{old}")
        assert alias is module
        assert any(f"lightning_zeropp.core.{new}" in str(w.message) for w in seen), old
        assert module.__spec__.name == f"lightning_zeropp.core.{new}"  # its own, kept


def _check_alias(old: str, new: str) -> None:
    module = importlib.import_module(new)
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        alias = importlib.import_module(old)
    assert alias is module, old
    assert [w for w in seen if w.category is DeprecationWarning and new in str(w.message)], old
    assert module.__spec__.name == new


def test_fronts_old_paths_are_the_modules_at_their_new_paths() -> None:
    import lightning_zeropp.accelerate
    import lightning_zeropp.lightning
    import lightning_zeropp.transformers  # noqa: F401

    for old, new in FRONTS_MOVED.items():
        _check_alias(old, new)
    # Every front's table is covered here (a new rename adds its line to FRONTS_MOVED).
    installed = {
        f"{package}.{old}": f"{package}.{new}"
        for package, table in TABLES.items()
        if package != "lightning_zeropp.core"
        for old, new in table.items()
    }
    assert installed == FRONTS_MOVED


def test_fronts_old_paths_in_a_fresh_interpreter() -> None:
    """As a user's script writes them, before anything imported the fronts: the names import."""
    code = (
        "import warnings\n"
        "warnings.filterwarnings('always', message='lightning_zeropp[.].* moved to')\n"
        "from lightning_zeropp.accelerate.zeropp_plugin import ZeroPPPlugin\n"
        "from lightning_zeropp.accelerate.plugin import prepare_pipeline\n"
        "from lightning_zeropp.accelerate.pipeline_model import PipelineModel, PipelineOutput\n"
        "from lightning_zeropp.lightning.resume import ResumingLoader, resuming_loader\n"
        "from lightning_zeropp.transformers.checkpoint import save, load\n"
        "import lightning_zeropp.accelerate as a, lightning_zeropp.lightning as l\n"
        "assert ZeroPPPlugin is a.ZeroPPPlugin and prepare_pipeline is a.prepare_pipeline\n"
        "assert PipelineModel is a.PipelineModel\n"
        "from lightning_zeropp.lightning.data import ResumingLoader as R\n"
        "assert ResumingLoader is R\n"
        "print('OK')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]
    for old, new in FRONTS_MOVED.items():
        assert f"{old} moved to {new}" in proc.stderr, (old, proc.stderr[-2000:])


def test_folders_that_replaced_files_keep_their_names() -> None:
    from lightning_zeropp.core.schedule import SCHEDULES, build_schedule  # noqa: F401
    from lightning_zeropp.core.shard import local_shard, shard_stage  # noqa: F401
    from lightning_zeropp.core.split import BlockPlan, find_blocks, split_model  # noqa: F401


def test_the_library_itself_imports_no_old_path() -> None:
    """In a fresh interpreter: importing every module of the library warns of no moved path."""
    names = [
        m.name
        for m in pkgutil.walk_packages(lightning_zeropp.__path__, "lightning_zeropp.")
        if not m.name.endswith("__main__")
    ]
    code = (
        "import importlib, warnings\n"
        "warnings.filterwarnings('error', message='lightning_zeropp[.].* moved to')\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
