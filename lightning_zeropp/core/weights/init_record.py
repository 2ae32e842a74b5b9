"""Recording a model's construction on the meta device for `core.weights.init_tape`: the calls
its constructor makes on its parameters (and on values computed from them) and every random draw,
while it is built under `empty_parameters()`."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_zeropp.core._torch_private import tree_flatten, tree_map
from lightning_zeropp.core.weights.init_tape import (
    InitTape,
    _Call,
    _Ref,
    draws,
    get_states,
    tensors,
)

__all__ = ["follow_parameter", "recording", "tape_of"]

# id(parameter) -> (a weak reference to it, its tape, its ref): parameters hash by identity here
# (a WeakKeyDictionary would compare tensors by value).
_TAPES: dict[int, tuple[weakref.ref[torch.Tensor], InitTape, int]] = {}


class _Recorder(TorchFunctionMode):
    """Records the calls an `InitTape` needs while a model is built (see the module docstring)."""

    def __init__(self, tape: InitTape) -> None:
        super().__init__()
        self.tape = tape
        self.refs: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (tensor, ref)

    def follow(self, tensor: torch.Tensor, root: int | None = None) -> int:
        ref = len(self.tape.shapes)
        self.tape.shapes.append((tensor.shape, tensor.dtype))
        self.tape.roots[ref] = ref if root is None else root
        self.refs[id(tensor)] = (tensor, ref)
        return ref

    def ref_of(self, x: Any) -> int | None:
        found = self.refs.get(id(x)) if isinstance(x, torch.Tensor) else None
        return found[1] if found is not None and found[0] is x else None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.record(func, args, kwargs, out)
        return out

    def record(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any], out: Any) -> None:
        name = getattr(func, "__name__", "")
        leaves = tree_flatten((args, kwargs))[0]
        refs = {r for r in map(self.ref_of, leaves) if r is not None}
        drew = draws(name)
        if not refs and not drew:
            return
        outs = tensors(out)
        if refs and not outs and not drew:
            return  # a query (shape, dim, ...): nothing to replay
        foreign = any(
            isinstance(t, torch.Tensor) and t.is_meta and self.ref_of(t) is None for t in leaves
        )
        encoded = tree_map(
            lambda x: _Ref(r) if (r := self.ref_of(x)) is not None else x, (args, kwargs)
        )
        root = min((self.tape.roots[r] for r in refs), default=None)
        out_refs = []
        for t in outs:
            known = self.ref_of(t)
            out_refs.append(known if known is not None else (self.follow(t, root) if refs else -1))
        self.tape.calls.append(
            _Call(func, encoded, frozenset(refs), tuple(out_refs), drew, foreign)
        )


_active: list[_Recorder] = []

# `torch.nn.init` functions that do not pass through the torch-function mode as one call (they run
# their own ops, and some return at once on a meta tensor, or draw as many times as the values they
# draw require): while recording they are recorded whole, as one call each.
_WHOLE = (
    "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_normal_",
    "orthogonal_", "sparse_", "trunc_normal_",
)  # fmt: skip


@contextlib.contextmanager
def _whole_init_calls() -> Iterator[None]:
    originals = {name: getattr(nn.init, name) for name in _WHOLE}

    def whole(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            recorder = _active[-1] if _active else None
            if recorder is None or recorder.ref_of(tensor) is None:
                return original(tensor, *args, **kwargs)
            recorder.record(original, (tensor, *args), kwargs, tensor)
            return tensor

        return call

    for name, original in originals.items():
        setattr(nn.init, name, whole(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(nn.init, name, original)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Record the construction inside on a fresh tape (`empty_parameters` enters it)."""
    tape = InitTape(start=get_states())
    recorder = _Recorder(tape)
    _active.append(recorder)
    try:
        with recorder, _whole_init_calls() if len(_active) == 1 else contextlib.nullcontext():
            yield
    finally:
        _active.remove(recorder)
        tape.end = get_states()


def follow_parameter(param: torch.Tensor) -> None:
    """A parameter created on the meta device while recording: the tape follows it."""
    if _active:
        recorder = _active[-1]
        ref = recorder.follow(param)
        recorder.tape.params.add(ref)
        key = id(param)
        _TAPES[key] = (weakref.ref(param, lambda _: _TAPES.pop(key, None)), recorder.tape, ref)


def tape_of(model: nn.Module) -> tuple[InitTape, dict[str, int]] | None:
    """The tape that recorded `model`'s construction and each parameter name's ref in it."""
    found: dict[str, int] = {}
    tape = None
    for name, p in model.named_parameters(remove_duplicate=False):
        entry = _TAPES.get(id(p))
        if entry is None or entry[0]() is not p or (tape is not None and entry[1] is not tape):
            continue
        tape = entry[1]
        found[name] = entry[2]
    return (tape, found) if tape is not None else None
