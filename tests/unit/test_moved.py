"""The core's old flat import paths still import, as the same module objects, with a warning that
names the new path; and no module of the library imports an old path itself."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import warnings

import lightning_zeropp
from lightning_zeropp.core._moved import MOVED


def test_every_old_path_is_the_module_at_its_new_path() -> None:
    for old, new in MOVED.items():
        module = importlib.import_module(f"lightning_zeropp.core.{new}")
        sys.modules.pop(f"lightning_zeropp.core.{old}", None)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            alias = importlib.import_module(f"lightning_zeropp.core.{old}")
        assert alias is module
        assert any(f"lightning_zeropp.core.{new}" in str(w.message) for w in seen), old


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
        "warnings.filterwarnings('error', message='lightning_zeropp.core.* moved to')\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
