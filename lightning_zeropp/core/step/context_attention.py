"""Context parallelism's attention: a model's own `F.scaled_dot_product_attention` calls run over
the whole sequence, with no change to the model's code.

While the stages run, `ContextAttention` (a `TorchFunctionMode`) answers each call with this
rank's queries against the keys and values of every CP rank, all-gathered along the sequence in
the forward, their gradients reduce-scattered (summed) back in the backward. Two paths:
- by blocks (`core.step.context_blocks`): a call with no mask (causal or not) and no dropout,
  on the CPU; no mask is made and the gathered K/V are not kept;
- masked: the rest (a mask of the model's, dropout, another device). K and V are gathered by
  `gather_sequence` (a custom autograd Function) and kept by the attention for its backward;
  the causal mask is built from the global positions of this rank's query chunks, once per
  micro-batch; a mask the model gives must already span the whole sequence's keys.
Grouped-query attention gathers the K/V heads only (the call's own `enable_gqa`). This runs
anywhere gloo or NCCL does; torch's ring attention is not used. A block's recomputation runs
under this mode too: the engine hands it to torch's checkpoint (`core.shard.fsdp`).

Positions a model makes itself stay global under the same mode: a `torch.arange(T)`-valued index
into an embedding table (the bundled GPT's `pos_emb(arange(T))`) and a parameter sliced `[:T]`
(a learned table read as `self.pos[: idx.shape[1]]`) read this rank's global positions instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_zeropp.core.step.context import ContextSplit
from lightning_zeropp.core.step.context_blocks import (
    block_attention,
    blocks_apply,
)
from lightning_zeropp.core.step.context_gather import gather_sequence, whole_sequences
from lightning_zeropp.core.step.context_masks import call_mask, local_causal

__all__ = ["ContextAttention", "gather_sequence", "whole_sequences"]

_aten = torch.ops.aten


class ContextAttention(TorchFunctionMode):
    """CP attention and global positions for the stages' forward (and any recomputation)."""

    def __init__(self, split: ContextSplit, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.split, self.group = split, group
        self.calls = 0  # attention calls taken over (a model with none is refused)
        self._paused = False
        # The last call's mask and what it was made from (kept: their ids cannot be reused).
        self._last: tuple[tuple[Any, ...], torch.Tensor | None] | None = None
        self._causal_read: tuple[torch.Tensor, bool] | None = None  # the last model mask read
        self._depth = 0  # entered by the step, and again by each block's recomputation in it

    def __enter__(self) -> ContextAttention:
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if not self._depth:
            self._last = self._causal_read = None  # a step's masks are not held past it
        super().__exit__(*exc)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Plain torch inside: the pipeline's shape inference, whose inputs on a later stage are
        not real (every CP rank of a stage infers at once, so none waits on a gather)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        if self._paused or (isinstance(first, torch.Tensor) and first.is_meta):
            # a call stage's pass over the parts another stage owns (on the meta device): shapes
            # only, which the split keeps; a batch's mask over all keys (`context_masks.row_mask`)
            # is cut to this rank's keys for it
            if func is F.scaled_dot_product_attention:
                kwargs = self._local_keys(args, kwargs)
            return func(*args, **kwargs)
        # the eager functions, and the aten ops a traced stage (split="trace") calls instead
        if (
            func is F.scaled_dot_product_attention
            or func is _aten.scaled_dot_product_attention.default
        ):
            self.calls += 1
            return self.attention(*args, **kwargs)
        if func is F.embedding:
            return func(self._global_index(args[0], args[1]), *args[1:], **kwargs)
        if func is _aten.embedding.default:  # (weight, indices, ...)
            return func(args[0], self._global_index(args[1], args[0]), *args[2:], **kwargs)
        if func is torch.Tensor.__getitem__ and isinstance(args[0], nn.Parameter):
            return self._global_slice(args[0], args[1])
        if func is _aten.slice.Tensor and isinstance(args[0], nn.Parameter):
            dim, start, end, step = (*args[1:], None, None, None, None)[:4]
            dim = 0 if dim is None else dim
            key = (slice(None),) * dim + (slice(start, end, step),)
            return self._global_slice(args[0], key, lambda: func(*args, **kwargs))
        return func(*args, **kwargs)

    def _local_keys(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """`kwargs` with a mask over all the sequence's keys cut to this rank's own (for a pass
        whose keys are not gathered)."""
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        key = kwargs.get("key", args[1] if len(args) > 1 else None)
        if (
            isinstance(mask, torch.Tensor)
            and isinstance(key, torch.Tensor)
            and mask.shape[-1] == self.split.length != key.shape[-2]
            and "attn_mask" in kwargs
        ):
            kwargs = {**kwargs, "attn_mask": self.split.local(mask, -1)}
        return kwargs

    def check_taken(self, device: torch.device) -> None:
        """After the first step, on every rank: some stage's attention was taken over. A model
        whose attention is written by hand would attend within each rank's chunks only."""
        seen = torch.tensor([float(self.calls)], device=device)
        dist.all_reduce(seen)
        if not seen.item():
            raise ValueError(
                "context parallelism (cp_size > 1) found no call of torch's "
                "scaled_dot_product_attention in the model: its attention would see each rank's "
                "part of the sequence only. Compute attention with "
                "torch.nn.functional.scaled_dot_product_attention (HF: "
                'attn_implementation="sdpa"), or set cp_size=1.'
            )

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        split = self.split
        local, length = split.local_length, split.length
        if query.shape[-2] != local or key.shape[-2] != local:
            raise ValueError(
                "context parallelism runs self-attention over the split sequence only: "
                f"scaled_dot_product_attention got {query.shape[-2]} queries and "
                f"{key.shape[-2]} keys where this rank holds {local} of the {length} tokens; "
                "set cp_size=1 for this model."
            )
        if attn_mask is not None and not is_causal and self._local_causal(attn_mask):
            # a causal mask the model built over its own chunk (a traced HF stage does): the
            # causal mask over global positions is meant
            attn_mask, is_causal = None, True
        if blocks_apply(query, key, value, attn_mask, dropout_p, enable_gqa):  # no mask made
            chunks = (split.rank, 2 * split.size - 1 - split.rank)
            return block_attention(
                query, key, value, self.group, split.order, chunks, is_causal, scale
            )
        mask = self._mask(attn_mask, is_causal, query)  # before the gathers: no rank waits
        key = gather_sequence(key, self.group, split.order)
        value = gather_sequence(value, self.group, split.order)
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale,
            enable_gqa=enable_gqa,
        )  # fmt: skip

    def _local_causal(self, mask: torch.Tensor) -> bool:
        """`context_masks.local_causal` of a model's mask, read once per mask object: every
        layer's call gets the same one, and reading it costs (local length)^2 work."""
        if self._causal_read is not None and self._causal_read[0] is mask:
            return self._causal_read[1]
        causal = local_causal(mask, self.split.local_length)
        self._causal_read = mask, causal
        return causal

    def _mask(
        self, attn_mask: torch.Tensor | None, is_causal: bool, query: torch.Tensor
    ) -> torch.Tensor | None:
        """The mask a call runs under: the causal mask over this rank's global positions and
        all keys, combined with the model's own. One tensor per micro-batch: every layer's call
        gets the same model mask (or none), so the first call's mask serves the rest, and SDPA
        saves one for backward rather than one per layer. Additive, in the query's dtype: a
        boolean mask would be converted to one by torch's kernels anew on every call."""
        split = self.split
        made_from = (
            split.positions, attn_mask, is_causal, query.device, query.dtype,
            torch.is_inference_mode_enabled(),  # an inference tensor cannot be saved later
        )  # fmt: skip
        last = self._last
        if last is not None and all(map(_same, last[0], made_from)):
            return last[1]
        mask = call_mask(attn_mask, is_causal, query, split.positions, split.length)
        self._last = made_from, mask
        return mask

    def _global_index(self, index: Any, weight: Any) -> Any:
        """A position index `arange(T_local)` (1-D, or one row) into a table of at least the
        global length: this rank's global positions."""
        split = self.split
        if (
            isinstance(index, torch.Tensor)
            and not index.is_floating_point()
            and (index.dim() == 1 or (index.dim() == 2 and index.shape[0] == 1))
            and index.shape[-1] == split.local_length
            and isinstance(weight, torch.Tensor)
            and weight.shape[0] >= split.length
            and torch.equal(
                index.reshape(-1), torch.arange(split.local_length, device=index.device)
            )
        ):
            return split.positions.to(index.device).reshape(index.shape)
        return index

    def _global_slice(self, table: torch.Tensor, key: Any, plain: Any = None) -> torch.Tensor:
        """`table[:T_local]` (or `table[:, :T_local]`) on a parameter of at least the global
        length along that dimension: its rows at this rank's global positions."""
        split = self.split
        keys = key if isinstance(key, tuple) else (key,)
        head = [k == slice(None) for k in keys]
        if all(isinstance(k, slice) for k in keys) and head.count(False) == 1:
            dim = head.index(False)
            cut = keys[dim]
            if (
                cut.start in (None, 0)
                and cut.step in (None, 1)
                and cut.stop == split.local_length
                and table.shape[dim] >= split.length
            ):
                return table.index_select(dim, split.positions.to(table.device))
        return plain() if plain is not None else table[key]


def _same(a: Any, b: Any) -> bool:
    """Tensors by identity (the same mask object), anything else by value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return bool(a == b)
