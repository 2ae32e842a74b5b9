"""One module view over the stages a rank holds, with the model's original parameter names.

With several stages per rank (interleaved or V schedules) the rank's parameters live in several
stage modules that each mirror part of the original tree (`blocks.0`, `blocks.4`, ...). The merged
view shares their leaves (no copies) under one root, so `named_parameters()`, `state_dict()` and
distributed checkpoints use the same names as the unsplit model, whatever the layout.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["merge_stage_modules"]


class _MergedTree(nn.Module):
    """A container created by the merge (never one of the user's modules)."""


def merge_stage_modules(modules: Sequence[nn.Module]) -> nn.Module:
    """A module whose tree is the union of `modules`' trees; the module itself if there is one."""
    if len(modules) == 1:
        return modules[0]
    root = _MergedTree()
    for module in modules:
        _merge_into(root, module)
    return root


def _merge_into(dst: nn.Module, src: nn.Module) -> None:
    for name, param in src._parameters.items():
        if param is None:
            continue
        if name in dst._parameters and dst._parameters[name] is not param:
            raise ValueError(f"parameter {name!r} is held by two stages of this rank")
        dst._parameters[name] = param
    for name, buf in src._buffers.items():
        # Stages may each keep a copy of a constant buffer (e.g. rotary frequencies): keep one.
        if buf is not None and name not in dst._buffers:
            dst._buffers[name] = buf
            if name in src._non_persistent_buffers_set:
                dst._non_persistent_buffers_set.add(name)
    for name, child in src._modules.items():
        if child is None:
            continue
        existing = dst._modules.get(name)
        if existing is None or existing is child:
            dst._modules[name] = child
            continue
        if not isinstance(existing, _MergedTree):
            merged = _MergedTree()
            _merge_into(merged, existing)
            dst._modules[name] = existing = merged
        _merge_into(existing, child)
