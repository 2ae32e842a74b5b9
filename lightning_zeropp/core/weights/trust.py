"""Checkpoints as data: nothing the library or a front reads from a checkpoint can run code.

A pickle names functions to call while it is read; a crafted one runs any of them. Every pickle
read from a checkpoint directory is read as data, and a refusal is a `ValueError` naming the file
and what it would have called (never suggesting to allow a callable: only a data class of the
user's may be allowed, by name):

- `read_data`: `torch.load(weights_only=True)` whatever the caller asked, allowing only data types
  (`trusted` classes: the running module's own hyperparameters, built in this process already;
  `allowed`: a framework's own allowlist, numpy's RNG state types). `meta.pt` (`load_meta`), a
  Lightning checkpoint file, the Trainer's `scheduler.pt` and `rng_state_<i>.pth`, Accelerate's
  registered objects and RNG states go through it, each after its checksum.
- `weights_only_loads`: torch's switch forcing `weights_only=True` on every `torch.load`, around
  a framework's own load that asks for `weights_only=False` (Accelerate's registered objects).
- DCP's `.metadata`, which DCP itself reads with a plain `pickle.load`: `check_metadata` first
  reads it with an unpickler that knows only DCP's metadata classes, dtypes and paths
  (`_torch_private.is_dcp_metadata_global`), and refuses the checkpoint naming what else it names.
- DCP's non-tensor items (optimizer hyperparameters), which DCP's default planner reads with
  `torch.load(weights_only=False)`: `SafeLoadPlanner` reads each with `weights_only=True` first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import os
import pickle
import pickletools
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

from lightning_zeropp.core._torch_private import is_dcp_metadata_global
from lightning_zeropp.core.weights import checksum

__all__ = [
    "SafeLoadPlanner",
    "check_metadata",
    "load_meta",
    "read_data",
    "trusted_types",
    "weights_only_loads",
]

_BUILTIN_MODULES = ("builtins", "collections", "torch")
_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch.load reads weights_only=True while set


def load_meta(path: Path, trusted: Iterable[type] = ()) -> Any:
    """`meta.pt`: `read_data(path, trusted)`."""
    return read_data(path, trusted)


def read_data(
    path: Path, trusted: Iterable[type] = (), allowed: Iterable[Any] = (), mmap: bool = False
) -> Any:
    """`torch.load(path, weights_only=True)`, allowing the classes in `trusted` and the data
    globals in `allowed` (a framework's own allowlist: numpy's RNG state types); a file that
    names anything else, or that is no readable pickle, is refused naming it (`ValueError`)."""
    extra = [*trusted, *allowed]
    try:
        with torch.serialization.safe_globals(extra):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise ValueError(_refusal(path, extra, err)) from None
    except (RuntimeError, EOFError, ValueError, OSError) as err:  # not a checkpoint at all
        raise ValueError(
            f"{path} cannot be read ({type(err).__name__}: {str(err).splitlines()[0][:200]}): "
            "the file is damaged or was replaced. Use another checkpoint (an earlier save, or a "
            "copy of this one)."
        ) from None


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every `torch.load` inside reads with `weights_only=True`, even where a framework asks
    for `weights_only=False` (torch's own switch, `TORCH_FORCE_WEIGHTS_ONLY_LOAD`): around a
    framework's checkpoint load whose files the front has checked, so that a file changed
    between the check and the framework's read still cannot run code."""
    before = os.environ.get(_FORCE)
    os.environ[_FORCE] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_FORCE, None)
        else:
            os.environ[_FORCE] = before


def _refusal(path: Path, allowed: list[Any], err: Exception) -> str:
    """Why `path` is refused, and a fix only where one is safe: a data class the user may
    allow by name; never a function (allowing one lets the file call it)."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - a plain pickle, not torch's zip format
        names = _pickle_globals(path)
    known = {_qualified(t) for t in [*torch.serialization.get_safe_globals(), *allowed]}
    unknown = [n for n in names if n not in known] or names
    if not unknown:
        said = re.search(r"WeightsUnpickler error: \s*(.+)", str(err))
        return (
            f"{path} cannot be read as data ({said[1][:200] if said else type(err).__name__}): "
            "the checkpoint was crafted or damaged; do not load it. Use a checkpoint you wrote."
        )
    data = [n for n in unknown if _is_data_class(n)]
    if data and len(data) == len(unknown):
        return (
            f"{path} names {', '.join(unknown)}, which loading would construct: the library "
            "reads checkpoint files as data (weights_only=True), whatever the caller asked. If "
            "the class is yours and you trust this checkpoint, allow it before loading with "
            f"torch.serialization.add_safe_globals([{data[0].rpartition('.')[2]}])."
        )
    return (
        f"{path} names {', '.join(unknown)}, which loading would call: a checkpoint this library "
        "or its fronts write holds data only, so this one was crafted or damaged. Do not load "
        "it; use a checkpoint you wrote (an earlier save, or a copy)."
    )


def _pickle_globals(path: Path) -> list[str]:
    """The globals a plain pickle file names, read from its opcodes (nothing is run)."""
    names: list[str] = []
    strings: list[str] = []
    try:
        with open(path, "rb") as stream:
            for op, arg, _ in pickletools.genops(stream):
                if op.name == "GLOBAL":
                    names.append(str(arg).replace(" ", "."))
                elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                    names.append(f"{strings[-2]}.{strings[-1]}")
                elif isinstance(arg, str):
                    strings.append(arg)
    except Exception:  # noqa: BLE001 - not a pickle at all: nothing named
        pass
    return list(dict.fromkeys(names))


def _qualified(value: Any) -> str:
    if isinstance(value, tuple):  # (object, "name") entries of torch's allowlist
        return str(value[1])
    return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', value)}"


def _is_data_class(name: str) -> bool:
    """Whether `module.Name` is a dataclass or an enum of an already imported module (looked up
    without importing anything the file names)."""
    module, _, attr = name.rpartition(".")
    value = getattr(sys.modules.get(module), attr, None)
    return isinstance(value, type) and (
        dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)
    )


def trusted_types(*objects: Any) -> set[type]:
    """The classes of the non-builtin values inside `objects` (dicts, lists, tuples and
    dataclasses walked): the running module's own hyperparameters, constructed in this process
    already, may come back from its checkpoint."""
    found: set[type] = set()
    stack = list(objects)
    seen: set[int] = set()
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            found.add(type(value))
            stack.extend(getattr(value, f.name) for f in dataclasses.fields(value))
        elif type(value).__module__.split(".")[0] not in _BUILTIN_MODULES:
            found.add(type(value))
    return found


def check_metadata(path: Path) -> None:
    """Read `path/.metadata` as DCP would, but with only DCP's own classes allowed; raise
    `ValueError` naming the file and the first other global it names."""
    file = path / ".metadata"
    if not file.is_file():
        raise ValueError(
            f"{path} has no .metadata: it is not a complete distributed checkpoint (a save "
            "killed before it finished, or a partial copy). Use another checkpoint."
        )
    with open(file, "rb") as stream:
        try:
            _MetadataUnpickler(stream).load()
        except _Refused as refused:
            raise ValueError(
                f"{file} names {refused.name}, which unpickling would call: it is not the "
                "metadata torch's distributed checkpoint writes. The checkpoint was crafted or "
                "damaged: do not load it; use a checkpoint you wrote."
            ) from None
        except (pickle.UnpicklingError, EOFError, ValueError) as err:
            raise ValueError(
                f"{file} cannot be read ({type(err).__name__}: {err}): the checkpoint is "
                "damaged. Use another one (an earlier save, or a copy)."
            ) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, whose non-tensor items must load with `weights_only=True`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(
                f"the checkpoint item {read_item.dest_index.fqn} would run code when loaded "
                f"({str(err).splitlines()[-1][:200]}): the checkpoint was crafted or damaged; "
                "do not load it."
            ) from None
        value.seek(0)
        super().load_bytes(read_item, value)


class _Refused(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not is_dcp_metadata_global(module, name):
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


def content_problem(path: Path, rank: int, world: int) -> str | None:
    """This rank's share of the checks that read a checkpoint's files before anything is loaded:
    its checksums, then `.metadata`'s globals, as one line naming the problem (None: none)."""
    try:
        if problem := checksum.verify(path, rank, world):
            return problem
        check_metadata(path)  # raises ValueError on a global DCP does not own
        return None
    except ValueError as err:
        return str(err)
