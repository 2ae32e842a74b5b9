"""The head and the cross-entropy over chunks of tokens: a micro-batch's logits never exist whole.

With today's vocabularies the logits are the biggest activation of a decoder: 4096 tokens over a
128k vocabulary are 2.1 GB in fp32, and a whole-logits cross-entropy keeps them (its softmax) for
backward. `linear_cross_entropy` computes `cross_entropy(hidden @ weight.T + bias, target)` a chunk
of `chunk` tokens at a time. Each chunk runs under torch's non-reentrant activation checkpoint, so
what is kept for backward is the hidden states, the weight and the targets only; backward
recomputes one chunk's logits at a time, and its gradient, then frees them. The sum of the chunks'
summed losses is the whole cross-entropy's sum (fp32 logits, as a whole-logits loss upcasts them),
so the loss and every gradient agree with whole logits up to the order of fp32 additions.

The chunk is the `loss_chunk` setting (`ZeroPPConfig`; 0 turns chunking off): the engine sets it
for the process (`set_loss_chunk`) and the model code that computes a loss this way reads it
(`loss_chunk`). Pure torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["DEFAULT_LOSS_CHUNK", "linear_cross_entropy", "loss_chunk", "set_loss_chunk"]

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


def loss_chunk() -> int:
    """Tokens per chunk of the head and the loss (0: whole logits)."""
    return _chunk


def _chunk_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
) -> torch.Tensor:
    # The logits in fp32, as a whole-logits loss computes them (`.float()` before the loss).
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")


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
    tokens whose target is not `ignore_index`, `chunk` tokens at a time (default: `loss_chunk()`;
    0, or a chunk holding every token, computes the whole logits at once).

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
        return _chunk_loss(flat, weight, bias, labels, ignore_index)
    total = flat.new_zeros((), dtype=torch.float32)
    # One split node: backward gathers the chunks' input gradients into one tensor at once.
    for part, part_labels in zip(flat.split(chunk), labels.split(chunk), strict=True):
        if torch.is_grad_enabled():
            # Keeps the chunk's inputs only; its logits are recomputed in backward, one chunk at
            # a time (no random draws inside, so no RNG state to keep).
            value = checkpoint(
                _chunk_loss,
                part,
                weight,
                bias,
                part_labels,
                ignore_index,
                use_reentrant=False,
                preserve_rng_state=False,
            )
        else:
            value = _chunk_loss(part, weight, bias, part_labels, ignore_index)
        total = total + value
    return total
