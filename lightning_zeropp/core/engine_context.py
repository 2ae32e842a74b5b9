"""The engine's context parallelism: each CP rank's part of a batch, and attention over whole
sequences while a step runs.

`EngineContext` is what `ZeroPPEngine` holds under `cp_size > 1` (None without): it refuses a
model whose attention it cannot split (at setup, on every rank alike, before the mesh's
collectives), cuts the example micro-batch and every step's batch along the sequence
(`core.step.context`), and, once the mesh exists, runs attention over whole sequences
(`core.step.context_attention`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_zeropp.core.mesh import ParallelDims
from lightning_zeropp.core.step.context import ContextSplit, attention_refusal
from lightning_zeropp.core.step.context_attention import ContextAttention
from lightning_zeropp.core.step.context_gather import whole_sequences

__all__ = ["EngineContext"]


class EngineContext:
    """Context parallelism over `cp_size` ranks for `model` (refused here when its attention
    cannot be split); `bind` it to the mesh before the first step."""

    def __init__(self, cp_size: int, model: nn.Module) -> None:
        if (refusal := attention_refusal(model)) is not None:
            raise ValueError(refusal)
        self.split = ContextSplit(cp_size, 0, model)
        self.attention: ContextAttention | None = None
        self.dims: ParallelDims | None = None

    def example(
        self, args: tuple[Any, ...] | None, kwargs: dict[str, Any] | None
    ) -> tuple[tuple[Any, ...] | None, dict[str, Any] | None]:
        """The example micro-batch as one CP rank's part (shapes are what the split methods
        read); a bad sequence length is refused here, at setup, on every rank."""
        if args is None and kwargs is None:
            return args, kwargs
        split_args, split_kwargs, _ = self.split.split(args or (), kwargs or {}, None)
        return split_args, split_kwargs

    def bind(self, dims: ParallelDims) -> ContextAttention:
        """This rank's place on the CP axis of `dims`' mesh; the attention a step runs under."""
        assert dims.cp_group is not None  # cp_size > 1
        self.split.set_rank(dims.cp_rank)
        self.dims = dims
        self.attention = ContextAttention(self.split, dims.cp_group)
        return self.attention

    def batch(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any], Any, ValueError | None]:
        """This CP rank's part of the batch, or the batch as given and what is wrong with it
        (raised on every rank by the step's agreement)."""
        try:
            return (*self.split.split(args, kwargs, target), None)
        except ValueError as err:
            return args, kwargs, target, err

    def whole_sequences(self, output: Any) -> Any:
        """`output` with each tensor of this CP rank's part of the sequence gathered into whole
        sequences in order (`core.step.context_attention.whole_sequences`)."""
        if self.dims is None or self.dims.cp_group is None:
            return output
        return whole_sequences(output, self.split, self.dims.cp_group)
