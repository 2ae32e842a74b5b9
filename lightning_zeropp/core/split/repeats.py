"""Blocks of a profiled model that repeat an earlier one, not run again (`core.split.profile`): a
decoder's 80 identical layers cost what 2 do on the meta device, where every op still costs Python.
A block is known by its fingerprint (each submodule's class, parameter shapes and plain
attributes, its own index aside) and its call's shapes and plain values (`Repeats`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["Repeats", "repeats_skipped"]


class Repeats:
    """Blocks that repeat an earlier one are not run again: a decoder's 80 identical layers
    cost what 2 do (meta tensors still pay Python for every op).

    A block repeats another when both are the same module (class, parameter shapes, the plain
    attributes of every submodule, its own index aside) called with the same input shapes and
    values; once the last two such blocks have measured the same, the rest of them return a
    fresh output of the measured shape and are given the measured figures (`credit`).
    Different blocks (Gemma2's sliding and global layers) have different attributes and run."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.prints = [_fingerprint(b, i) for i, b in enumerate(blocks)]
        self.measured: dict[tuple, list[tuple[int, float, Any]]] = {}
        self.pending: dict[int, tuple] = {}  # blocks running for real, by index: their key
        self.stubbed: dict[int, tuple[int, float]] = {}  # blocks skipped: (saved, flops) owed

    def reset(self) -> None:  # a new run: what was measured with or without recompute differs
        self.measured.clear()
        self.pending.clear()
        self.stubbed.clear()

    def forward(self, i: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            key = (self.prints[i], _signature((args, kwargs)))
            runs = self.measured.get(key, [])
            # the last two alike (the first of a kind may differ: it saves what later ones share)
            if len(runs) >= 2 and runs[-1][:2] == runs[-2][:2]:
                self.stubbed[i] = runs[-1][:2]
                return _map_tensors(_fresh, runs[-1][2])
            self.pending[i] = key
            return original(*args, **kwargs)

        return forward

    def credit(self, i: int, saved: list[int], flops: list[float], output: Any) -> None:
        """After block i: record what it measured (the run's tally: `saved` bytes and `flops` per
        piece, block i's at i + 1), or credit what a skipped block owes."""
        if i in self.stubbed:  # what its wrappers (a checkpoint's) did for real is in these too
            saved[i + 1], flops[i + 1] = self.stubbed.pop(i)
        elif i in self.pending:
            entry = (saved[i + 1], flops[i + 1], output)
            self.measured.setdefault(self.pending.pop(i), []).append(entry)


@contextlib.contextmanager
def repeats_skipped(blocks: list[nn.Module]) -> Iterator[Repeats]:
    """`blocks` with their forwards wrapped by one `Repeats` for as long as it is held."""
    repeats = Repeats(blocks)
    for i, block in enumerate(blocks):
        block.forward = repeats.forward(i, block.forward)  # type: ignore[method-assign]
    try:
        yield repeats
    finally:
        for block in blocks:
            del block.forward


def _fingerprint(module: nn.Module, index: int) -> tuple:
    """What makes two blocks the same computation: each submodule's class, parameter shapes and
    plain attributes (numbers, strings, flags), leaving out any integer equal to the block's own
    index (its layer number)."""
    out = []
    for name, m in module.named_modules():
        attrs = tuple(
            sorted(
                (k, v)
                for k, v in vars(m).items()
                if not k.startswith("_")
                and isinstance(v, int | float | str | bool | type(None))
                and not (type(v) is int and v == index)
            )
        )
        params = tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters(recurse=False))
        out.append((name, type(m).__qualname__, attrs, params))
    return tuple(out)


def _signature(value: Any) -> Any:
    """A call's arguments as shapes and plain values (hashable): what the block computes on."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, list | tuple):
        return (type(value).__qualname__, tuple(_signature(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _signature(v)) for k, v in value.items()))
    if isinstance(value, int | float | str | bool | type(None)):
        return value
    return type(value).__qualname__


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """`value` with every tensor in its tuples, lists and dicts replaced by `fn(tensor)`."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_map_tensors(fn, v) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _map_tensors(fn, v)) for k, v in value.items())
    return value


def _fresh(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta", requires_grad=t.requires_grad)
