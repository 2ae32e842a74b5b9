"""Stand-ins on a call stage (`call_stages`) for what other stages hold: a module's `Stub` (zeros
shaped like its real output, or a block's input hidden state passed through) and a parameter's
zeros (`stand_in_parameter`). The code around them runs as in the model; what it computes from
them is replaced at the stage's first block or discarded (the dry run checked nothing else reads
it: `call_run`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_zeropp.core._torch_private import tree_flatten, tree_map
from lightning_zeropp.core.split.call_plan import CallPlan

__all__ = ["Stub", "stand_in_parameter"]


class Stub(nn.Module):
    """Stands in for a module held by another stage. An outer module's stub returns zeros shaped
    like its real output, worked out on a meta-device copy; a block's stub returns its input
    hidden state. The code around them runs on that; what it computes is replaced at the stage's
    first block or discarded (the dry run checked nothing else reads it)."""

    def __init__(
        self,
        meta: nn.Module,
        name: str,
        device: torch.device,
        block: CallPlan | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if dtype is not None:
            # The stage holding the module computes with its parameters and floating inputs
            # cast (FSDP2 mixed precision): the zeros here get the dtype the real output has,
            # which code after it may read (HF's rotary tables and float masks take it).
            for p in meta.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
        # Plain attributes, not submodules: a stub holds no parameters and no state.
        object.__setattr__(self, "_meta", meta)
        object.__setattr__(self, "_unit", name)
        object.__setattr__(self, "_device", device)
        object.__setattr__(self, "_block", block)
        object.__setattr__(self, "_dtype", dtype)
        # A block's stub with extras (`CallPlan.aux`): its index and the stage's state, whose
        # received extras an earlier block's stub returns.
        object.__setattr__(self, "_index", None)
        object.__setattr__(self, "_state", None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        plan = self._block
        if plan is not None:  # pass the hidden state through, shaped like a block's return
            hidden = tree_flatten((args, kwargs))[0][plan.slots[0]]
            if plan.out_index is None:
                return hidden
            out: list[Any] = [None] * plan.out_len
            if plan.aux:
                out = list(self._extras(args, kwargs))
            out[plan.out_index] = hidden
            return tuple(out)
        meta_args, meta_kwargs = tree_map(self._to_meta, (args, kwargs))
        out = self._meta(*meta_args, **meta_kwargs)
        return tree_map(self._zeros, out)

    def _extras(self, args: Any, kwargs: Any) -> Sequence[Any]:
        """An earlier block's extras as the previous stage sent them (their gradients flow back
        to it); a later block's are zeros shaped like its real ones (what the code after it
        computes from them is not sent)."""
        plan, state, index = self._block, self._state, self._index
        assert plan is not None and state is not None and index is not None
        if state.got_aux is not None and index < len(state.got_aux) // len(plan.aux):
            got = state.got_aux[index * len(plan.aux) : (index + 1) * len(plan.aux)]
            out: list[Any] = [None] * plan.out_len
            for j, value in zip(plan.aux, got, strict=True):
                out[j] = value
            return out
        meta_args, meta_kwargs = tree_map(self._to_meta, (args, kwargs))
        return [
            self._zeros(x) if j in plan.aux else None
            for j, x in enumerate(self._meta(*meta_args, **meta_kwargs))
        ]

    def _to_meta(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        cast = self._dtype is not None and x.is_floating_point()
        return torch.empty_like(x, device="meta", dtype=self._dtype if cast else x.dtype)

    def _zeros(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return torch.zeros(x.shape, dtype=x.dtype, device=self._device)

    def __getattr__(self, name: str) -> Any:
        # Attributes (flags, sub-configs, submodules) read from the meta-device copy; tensors
        # read that way are on the meta device, so using one in real compute fails loudly.
        return getattr(self.__dict__["_meta"], name)


def stand_in_parameter(
    stage: nn.Module, name: str, device: torch.device, dtype: torch.dtype | None
) -> None:
    """Replace a parameter another stage holds by zeros of its shape (in the compute dtype), as
    a plain attribute: the code reading it runs on them and what it computes is discarded, as
    with an outer module's stub."""
    path, _, leaf = name.rpartition(".")
    holder = stage.get_submodule(path)
    param = holder._parameters.pop(leaf)
    assert param is not None  # `name` is one of the stage's parameters
    cast = dtype is not None and param.is_floating_point()
    zeros = torch.zeros(param.shape, dtype=dtype if cast else param.dtype, device=device)
    object.__setattr__(holder, leaf, zeros)
