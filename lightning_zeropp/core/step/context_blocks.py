"""Context parallelism's attention without a mask: causal (or unmasked) attention over the
load-balanced chunks, computed block by block and merged by each block's log-sum-exp.

A CP rank holds global chunks `r` and `2 cp - 1 - r` of a sequence (`core.step.context`). Under
a causal mask the queries of chunk `i` see every key of chunks `0 .. i - 1` and the keys of
their own chunk causally, so each query chunk is two kernel calls with no mask at all: one over
the keys before it, one causal over its own chunk (square, so the kernel's top-left causal
alignment is the right one). Their outputs merge exactly by their log-sum-exp rows, as ring
attention merges its steps. The backward runs the kernel's own backward per block with the
merged output and log-sum-exp (the softmax over all blocks). In fp32 this is one process's
attention to rounding (1e-6); in bf16 each block's output is rounded before the fp32 merge, so
results may differ from one process's by one unit in the last place.

Against the masked path (`core.step.context_masks.call_mask`), nothing quadratic is kept: no
(local queries x all keys) mask lives through a micro-batch, and the gathered K and V are not
saved either. The backward all-gathers them again (as FSDP gathers weights again) and
reduce-scatters their gradients. Per call and micro-batch: one all-gather of K and V together
in the forward; one all-gather and one reduce-scatter in the backward.

The kernel is torch's CPU flash attention (`_torch_private.flash_attention_lse`), so this runs
where the queries are on the CPU; elsewhere `core.step.context_attention` keeps the masked path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_zeropp.core._torch_private import flash_attention_backward, flash_attention_lse

__all__ = ["block_attention", "blocks_apply", "gather_rows", "scatter_rows"]

Block = tuple[int, int, bool]  # keys [start, stop) of the global sequence, causal within


def gather_rows(x: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor) -> torch.Tensor:
    """Every CP rank's `x` all-gathered along dim -2, rows put in global order (`order[p]` is
    the gathered row of global position p)."""
    size = dist.get_world_size(group)
    rows = x.movedim(-2, 0).contiguous()
    gathered = rows.new_empty((size * rows.shape[0], *rows.shape[1:]))
    dist.all_gather_into_tensor(gathered, rows, group=group)
    return gathered.index_select(0, order.to(x.device)).movedim(0, -2)


def scatter_rows(grad: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor) -> torch.Tensor:
    """`gather_rows`'s adjoint: `grad` (global order along dim -2) back in gathered order, and
    reduce-scattered (summed: each rank's keys serve every rank's queries)."""
    size = dist.get_world_size(group)
    moved = grad.movedim(-2, 0).contiguous()
    rows = torch.empty_like(moved)
    rows.index_copy_(0, order.to(grad.device), moved)
    local = rows.new_empty((rows.shape[0] // size, *rows.shape[1:]))
    dist.reduce_scatter_tensor(local, rows, op=dist.ReduceOp.SUM, group=group)
    return local.movedim(0, -2)


def blocks_apply(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Any,
    dropout_p: float,
    enable_gqa: bool,
    device_type: str | None = None,
) -> bool:
    """Whether a call runs here: no mask, no dropout (the kernel is called without either), on
    the CPU (the kernel's device; `device_type` stands in for the query's on the meta device),
    and shapes the kernel computes as torch's attention does: 4-D, K and V alike (the head
    sizes of an MLA-style V differ), one batch for all three (the kernel does not broadcast
    K/V), and the heads equal or grouped as `enable_gqa` asks."""
    if attn_mask is not None or dropout_p or (device_type or query.device.type) != "cpu":
        return False
    if query.dim() != 4 or key.shape != value.shape or key.shape[0] != query.shape[0]:
        return False
    heads, kv_heads = query.shape[1], key.shape[1]
    return heads == kv_heads or (enable_gqa and heads % kv_heads == 0)


def key_blocks(chunk: int, size: int, length: int, is_causal: bool) -> list[Block]:
    """The key blocks the queries of global chunk `chunk` (of `size` tokens) attend over."""
    if not is_causal:
        return [(0, length, False)]
    start = chunk * size
    before = [(0, start, False)] if start else []
    return [*before, (start, start + size, True)]


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        group: dist.ProcessGroup,
        order: torch.Tensor,
        chunks: tuple[int, int],
        is_causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        kv = gather_rows(torch.stack([key, value]), group, order)  # one all-gather for both
        size = query.shape[-2] // len(chunks)
        # tokens before heads in memory, as the kernel lays out its output: a model's
        # `transpose(1, 2)` back to (batch, tokens, heads) is then a view of what is saved here
        out = query.new_empty(tuple(query.shape[i] for i in (0, 2, 1, 3))).transpose(1, 2)
        lses = []
        for j, chunk in enumerate(chunks):
            q = query[..., j * size : (j + 1) * size, :]
            parts = [
                flash_attention_lse(q, kv[0, ..., a:b, :], kv[1, ..., a:b, :], causal, scale)
                for a, b, causal in key_blocks(chunk, size, kv.shape[-2], is_causal)
            ]
            merged, lse = _merge(parts, query.dtype)
            out[..., j * size : (j + 1) * size, :] = merged
            lses.append(lse)
        lse = torch.cat(lses, -1)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.order, ctx.chunks = group, order, chunks
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        query, key, value, out, lse = ctx.saved_tensors
        kv = gather_rows(torch.stack([key, value]), ctx.group, ctx.order)  # gathered again
        grad = grad.contiguous()
        size = query.shape[-2] // len(ctx.chunks)
        acc = torch.float32 if query.element_size() < 4 else query.dtype  # sums of blocks
        d_query = torch.zeros(query.shape, dtype=acc, device=query.device)
        d_kv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        for j, chunk in enumerate(ctx.chunks):
            rows = slice(j * size, (j + 1) * size)
            q, g = query[..., rows, :], grad[..., rows, :]
            o, m = out[..., rows, :].contiguous(), lse[..., rows].contiguous()
            for a, b, causal in key_blocks(chunk, size, kv.shape[-2], ctx.is_causal):
                dq, dk, dv = flash_attention_backward(
                    g, q, kv[0, ..., a:b, :], kv[1, ..., a:b, :], o, m, causal, ctx.scale
                )
                d_query[..., rows, :] += dq
                d_kv[0, ..., a:b, :] += dk
                d_kv[1, ..., a:b, :] += dv
        del kv  # the backward's peak: the gathered K/V are not needed for the scatter
        # summed over the CP ranks in the accumulation dtype (fp32 for bf16), then cast
        d_local = scatter_rows(d_kv, ctx.group, ctx.order).to(key.dtype)
        return d_query.to(query.dtype), d_local[0], d_local[1], None, None, None, None, None


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> Any:
    """One attention output and log-sum-exp from those over disjoint blocks of keys: each
    block's output weighted by its share of the softmax's denominator (in fp32)."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.logsumexp(torch.stack([m for _, m in parts]), 0)
    out = sum(o.float() * torch.exp(m - lse).unsqueeze(-1) for o, m in parts)
    return out.to(dtype), lse  # type: ignore[union-attr]


def block_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    order: torch.Tensor,
    chunks: tuple[int, int],
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """This rank's queries (its global `chunks`, in order) against the keys and values of the
    whole sequence, causal or unmasked, with no mask made (differentiable)."""
    return _BlockAttention.apply(query, key, value, group, order, chunks, is_causal, scale)
