"""The head and the cross-entropy in pieces: a micro-batch's logits never exist whole.

With today's vocabularies the logits are the biggest activation of a decoder: 4096 tokens over a
128k vocabulary are 2.1 GB in fp32, and a whole-logits cross-entropy keeps them (its softmax) for
backward. `linear_cross_entropy` computes `cross_entropy(hidden @ weight.T + bias, target)` as one
autograd node (`_LinearCrossEntropy`) that keeps the hidden states, the weight and the targets
(and, cut by vocabulary, one log-sum-exp per token) only. It runs over pieces of the logits, each
no bigger than `chunk` tokens' whole rows, and its backward computes each piece's logits again,
their gradient, then frees them (`core.step.chunked_passes`): chunks of tokens where the head is
fp32 or frozen, slices of the vocabulary where its weight takes a bf16 gradient, so that every
sum over the pieces runs in fp32 without a buffer of the head's size. The loss and every gradient
agree with whole logits up to the order of fp32 additions; in bf16 within whole logits' own
rounding (tested against fp64).

One node, not a checkpoint per chunk, for the schedules that split backward into an input- and a
weight-gradient pass (ZB-V, DualPipeV, interleaved zero-bubble, ZeroPP): torch's split backward
keeps, from the first pass to the second, the gradient flowing into each node where a weight's
path joins the input's. Under a checkpoint per chunk those are the chunks' logits' gradients (the
whole logits again, held until the weight pass); here it is one scalar, the loss's. The input
pass (`will_backward_reach` tells the passes apart) computes the hidden states' gradient and, in
the same recompute of the logits, the head's weight gradient, which it keeps for the weight
pass: ZeroPP's held-back weight tasks find the weights released, so that pass reads no weight.

The chunk is the `loss_chunk` setting, in tokens (`ZeroPPConfig`; 0 turns chunking off, None
chunks where the run can): the engine sets it for the process (`chunk_for_run`,
`set_loss_chunk`) and the model code that computes a loss this way reads it (`loss_chunk`).
Pure torch.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_zeropp.core._torch_private import will_backward_reach
from lightning_zeropp.core.step import chunked_passes as passes

__all__ = [
    "DEFAULT_LOSS_CHUNK",
    "chunk_for_run",
    "linear_cross_entropy",
    "loss_chunk",
    "set_loss_chunk",
]

# Tokens per chunk: 1024 x a 128k vocabulary is 512 MB of fp32 logits, a quarter of a 4096-token
# micro-batch's; small chunks cost more matmul launches and a re-read of the weight per chunk.
DEFAULT_LOSS_CHUNK = 1024

_chunk = DEFAULT_LOSS_CHUNK


def set_loss_chunk(tokens: int) -> None:
    """Tokens per chunk of the head and the loss from now on in this process (0: whole logits)."""
    global _chunk
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"loss_chunk={tokens!r} must be a whole number of tokens >= 0 (0: off).")
    _chunk = tokens


def chunk_for_run(asked: int | None, split: object, num_stages: int, cp_size: int) -> int:
    """The chunk a run computes its head and loss in: `asked` (`loss_chunk`; None: the default)
    where it can, 0 (whole logits) where it cannot. Only the call split, or one stage (the model
    itself), hands the last stage the call's targets: a traced, pruned or user-cut stage takes
    activations, and the model computes its loss from whole logits. Under context parallelism a
    loss the model computes itself would cover this rank's part of the sequence only (a front
    gathers whole logits instead). A number asked for where the run cannot chunk is refused,
    never silently ignored."""
    whole = split == "call" or num_stages == 1  # the last stage runs the model's own call
    if whole and cp_size == 1:
        return DEFAULT_LOSS_CHUNK if asked is None else asked
    if asked:
        why = (
            f"split={split!r} hands the last stage activations, not the call's targets, so the "
            "model computes its loss from whole logits"
            if not whole
            else f"under context parallelism (cp_size={cp_size}) the loss is computed from the "
            "whole sequences' logits the front gathers"
        )
        fix = "use split='call', or " if not whole else ""
        raise ValueError(
            f"loss_chunk={asked} asks for the head and the loss in chunks, but {why}: "
            f"{fix}leave loss_chunk unset (None: chunks where the run can) or set it to 0."
        )
    return 0


def loss_chunk() -> int:
    """Tokens per chunk of the head and the loss (0: whole logits)."""
    return _chunk


def _viewed(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A view of `tensor` when it takes a gradient: its node can be asked whether a backward
    reaches it (a leaf's own node, its gradient accumulator, cannot be under `autograd.grad`)."""
    return tensor.view_as(tensor) if tensor is not None and tensor.requires_grad else tensor


_NONE = (None, None, None, None)  # no gradients for the targets, ignore_index, cut and nodes


class _LinearCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of `hidden @ weight.T + bias` in pieces (`core.step.chunked_passes`:
    `cut` is ("tokens", tokens a chunk) or ("vocab", vocabulary rows a slice)). Its inputs are
    views whose nodes (`nodes`) tell backward which gradients the pass wants."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        ignore_index: int,
        cut: tuple[str, int],
        nodes: tuple[Any, Any, Any],
    ) -> torch.Tensor:
        kind, size = cut
        if kind == "vocab":
            total, lse = passes.vocab_forward(hidden, weight, bias, target, ignore_index, size)
            ctx.save_for_backward(hidden, weight, bias, target, lse)
        else:
            total = passes.token_forward(hidden, weight, bias, target, ignore_index, size)
            ctx.save_for_backward(hidden, weight, bias, target)
        ctx.ignore_index, ctx.cut, ctx.nodes = ignore_index, cut, nodes
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # The gradients this pass reaches: all under a plain backward; one side under each pass
        # of a split backward.
        reach = [n is not None and will_backward_reach(n) for n in ctx.nodes]
        stash = getattr(ctx, "stash", None)
        if stash is not None:  # the weight pass: the input pass computed its gradients
            ctx.stash = None
            return None, *(g if r else None for g, r in zip(stash, reach[1:], strict=True)), *_NONE
        # Every gradient wanted at all, in one recompute of the logits: the input pass of a
        # split backward computes the weight's too and keeps it for the weight pass, which may
        # find the weight released (ZeroPP's held-back weight tasks) and would otherwise
        # recompute the logits once more.
        wants = [n is not None for n in ctx.nodes]
        (kind, size), ignore = ctx.cut, ctx.ignore_index
        if kind == "vocab":
            hidden, weight, bias, target, lse = ctx.saved_tensors
            d_hidden, d_weight, d_bias = passes.vocab_backward(
                hidden, weight, bias, target, lse, ignore, size, grad, wants
            )
        else:
            hidden, weight, bias, target = ctx.saved_tensors
            d_hidden, d_weight, d_bias = passes.token_backward(
                hidden, weight, bias, target, ignore, size, grad, wants
            )
        if (wants[1] and not reach[1]) or (wants[2] and not reach[2]):
            ctx.stash = (d_weight, d_bias)  # the input pass of a split backward
        return (
            d_hidden if reach[0] else None,
            d_weight if reach[1] else None,
            d_bias if reach[2] else None,
            *_NONE,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk: int | None = None,
) -> torch.Tensor:
    """The summed cross-entropy (fp32) of `hidden @ weight.T + bias` against `target` over the
    tokens whose target is not `ignore_index`, never more logits at once than `chunk` tokens'
    whole rows (default: `loss_chunk()`; 0, or a chunk holding every token, computes the whole
    logits at once). Without gradients (evaluation) it runs `chunk` tokens at a time.

    `hidden` is (..., dim) and `target` (...) of the same leading shape. Callers divide the sum
    by what their loss averages over (the labelled tokens, or the front's count)."""
    chunk = loss_chunk() if chunk is None else chunk
    flat = hidden.reshape(-1, hidden.shape[-1])
    labels = target.reshape(-1)
    if labels.shape[0] != flat.shape[0]:
        raise ValueError(
            f"linear_cross_entropy: {flat.shape[0]} hidden states but {labels.shape[0]} targets"
        )
    if chunk <= 0 or chunk >= flat.shape[0]:
        return passes.chunk_loss(flat, weight, bias, labels, ignore_index)
    if not torch.is_grad_enabled():
        return passes.token_forward(flat, weight, bias, labels, ignore_index, chunk)
    # By vocabulary rows where the head's weight takes a narrow (bf16, fp16) gradient, whose sum
    # over token chunks would need a head-sized fp32 buffer; by tokens otherwise (see
    # `chunked_passes`). A slice of rows holds as many logits as `chunk` tokens' whole rows.
    narrow = weight.requires_grad and weight.dtype.itemsize < 4
    rows = max(1, chunk * weight.shape[0] // flat.shape[0])
    cut = ("vocab", rows) if narrow else ("tokens", chunk)
    # Views, so that backward can ask of each input whether its pass reaches it (`_viewed`).
    h, w, b = _viewed(flat), _viewed(weight), _viewed(bias)
    nodes = tuple(None if t is None else t.grad_fn for t in (h, w, b))
    return _LinearCrossEntropy.apply(h, w, b, labels, ignore_index, cut, nodes)
