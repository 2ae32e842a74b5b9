"""Checkpoints as data: nothing the library reads from a checkpoint can run code.

A pickle names functions to call while it is read; a crafted one runs any of them. The library
reads three kinds of pickle from a checkpoint directory, and refuses code in each:

- `meta.pt`, its own file (Lightning's loop and callback state, the run's settings): always with
  `torch.load(weights_only=True)`, whatever `weights_only` the caller asked for. Objects of other
  classes in it (a hyperparameter dataclass) load only if the caller trusts their classes:
  `trusted` (the fronts pass the classes of the running module's own hyperparameters, built in
  this process already), or `torch.serialization.add_safe_globals([...])`.
- DCP's `.metadata`, which DCP itself reads with a plain `pickle.load`: `check_metadata` first
  reads it with an unpickler that knows only DCP's metadata classes, dtypes and paths
  (`_torch_private.is_dcp_metadata_global`), and refuses the checkpoint naming what else it names.
- DCP's non-tensor items (optimizer hyperparameters), which DCP's default planner reads with
  `torch.load(weights_only=False)`: `SafeLoadPlanner` reads each with `weights_only=True` first.

Every refusal is a `ValueError` naming the file and what it would have loaded.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

from lightning_zeropp.core._torch_private import is_dcp_metadata_global

__all__ = ["SafeLoadPlanner", "check_metadata", "load_meta", "trusted_types"]

_BUILTIN_MODULES = ("builtins", "collections", "torch")


def load_meta(path: Path, trusted: Iterable[type] = ()) -> Any:
    """`torch.load(path, weights_only=True)`, allowing the classes in `trusted`; a file that
    names anything else is refused naming it."""
    try:
        with torch.serialization.safe_globals(list(trusted)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # noqa: BLE001 - not a zip checkpoint at all: say what torch said
            names = []
        allowed = set(torch.serialization.get_safe_globals()) | set(trusted)
        allowed_names = {
            f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', t)}" for t in allowed
        }
        unknown = [n for n in names if n not in allowed_names] or names
        what = f"names {', '.join(unknown)}" if unknown else f"cannot be read safely ({err})"
        raise ValueError(
            f"{path} {what}, which loading would construct or call: the library reads its own "
            "checkpoint files with weights_only=True, whatever the caller asked. If you trust "
            "this checkpoint and the class is yours, allow it before loading with "
            f"torch.serialization.add_safe_globals([...]) (e.g. {unknown[0] if unknown else 'MyConfig'})."
        ) from None


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
