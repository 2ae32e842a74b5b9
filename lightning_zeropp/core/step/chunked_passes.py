"""The two ways `core.step.chunked_loss` cuts the head and the cross-entropy: by tokens, or by
vocabulary rows. Each is a forward and a backward over pieces of the logits, never all of them.

A whole-logits backward computes the hidden states' gradient (`d_logits @ weight`) and the
weight's (`d_logits.T @ hidden`) each in one matmul, summed in fp32 inside it and rounded once.
Cut into pieces, one of the two becomes a sum over the pieces:
- by tokens (`token_*`), a chunk of tokens with their whole rows of logits: each token's hidden
  gradient is one matmul, as with whole logits; the weight's is summed over the chunks. In fp32
  that sum is the gradient itself; in bf16 it needs an fp32 buffer of the head's size (2.1 GB for
  Llama-3-8B), or it rounds again at every chunk (8 chunks: 1.7x the whole logits' error);
- by vocabulary rows (`vocab_*`), every token over a slice of the rows: the weight's gradient is
  one matmul a slice, rounded once; the hidden states' is summed over the slices in fp32 (a
  buffer of tokens x dim, small). The forward merges the slices' log-sum-exps and keeps one per
  token for the backward, which computes each slice's logits with the same shapes, so the same
  numbers.
`chunked_loss` cuts by vocabulary where the weight takes a bf16 (or fp16) gradient, and by tokens
otherwise (fp32, where both are exact to fp32 round-off, or a frozen head: LoRA).

No boolean indexing anywhere: it would wait for the device (nonzero) in every piece, and the
meta device, where the planner runs the loss (`plan.loss_memory`), cannot index by values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["token_backward", "token_forward", "vocab_backward", "vocab_forward"]

Tensor = torch.Tensor
Grads = tuple[Tensor | None, Tensor | None, Tensor | None]


def token_forward(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, ignore: int, chunk: int
) -> Tensor:
    """The summed cross-entropy (fp32), `chunk` tokens at a time, as whole logits compute it."""
    total = hidden.new_zeros((), dtype=torch.float32)
    for part, labels in zip(hidden.split(chunk), target.split(chunk), strict=True):
        total = total + chunk_loss(part, weight, bias, labels, ignore)
    return total


def chunk_loss(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, ignore: int
) -> Tensor:
    """The summed cross-entropy of whole logits, in fp32 (`.float()`, as a whole-logits loss)."""
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, target, ignore_index=ignore, reduction="sum")


def token_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore: int,
    chunk: int,
    grad: Tensor,
    wants: list[bool],
) -> Grads:
    """The gradients `wants` asks for (hidden, weight, bias), `chunk` tokens at a time."""
    d_hidden = torch.zeros_like(hidden) if wants[0] else None
    d_weight = _accumulator(weight) if wants[1] else None
    d_bias = _accumulator(bias) if wants[2] and bias is not None else None
    kept, label = _labels(target, ignore)
    scale = kept * grad.float()  # d(sum)/d(each token's loss), 0 where unlabelled
    for start in range(0, hidden.shape[0], chunk):
        part = hidden[start : start + chunk]
        logits = F.linear(part, weight, bias)
        d_logits = torch.softmax(logits.float(), dim=-1)
        _minus_one_hot(d_logits, label[start : start + chunk], 0)
        d_logits = (d_logits * scale[start : start + chunk]).to(logits.dtype)
        if d_hidden is not None:
            d_hidden[start : start + part.shape[0]] = d_logits @ weight
        if d_weight is not None:
            d_weight += d_logits.t() @ part
        if d_bias is not None:
            d_bias += d_logits.sum(dim=0, dtype=d_bias.dtype)
    return d_hidden, _cast(d_weight, weight), _cast(d_bias, bias)


def vocab_forward(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, ignore: int, rows: int
) -> tuple[Tensor, Tensor]:
    """The summed cross-entropy (fp32) and each token's log-sum-exp, `rows` vocabulary rows at a
    time; in place on one fp32 slice of logits."""
    kept, label = _labels(target, ignore)
    lse = hidden.new_full((hidden.shape[0],), float("-inf"), dtype=torch.float32)
    picked = hidden.new_zeros((hidden.shape[0],), dtype=torch.float32)
    found = torch.zeros_like(label, dtype=torch.bool)
    for start in range(0, weight.shape[0], rows):
        logits = _slice_logits(hidden, weight, bias, start, rows).float()
        inside, at = _where_in(label, start, logits.shape[1])
        found |= inside
        picked += torch.where(inside, logits.gather(1, at), 0.0).squeeze(1)
        most = logits.amax(dim=1, keepdim=True)
        lse = torch.logaddexp(lse, most.squeeze(1) + logits.sub_(most).exp_().sum(dim=1).log())
    kept = kept.squeeze(1)
    _check_labels(target, kept & ~found.squeeze(1), weight.shape[0], ignore)
    return torch.where(kept, lse - picked, 0.0).sum(), lse


def _check_labels(target: Tensor, missing: Tensor, vocab: int, ignore: int) -> None:
    """Raise as whole logits' cross-entropy does for a label no vocabulary row holds (one
    device sync a call; the meta device has no values to check)."""
    if missing.device.type != "meta" and bool(missing.any()):
        bad = int(target[missing][0])
        raise IndexError(
            f"linear_cross_entropy: target {bad} is out of bounds for a vocabulary of {vocab} "
            f"(ignore_index={ignore})."
        )


def vocab_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    lse: Tensor,
    ignore: int,
    rows: int,
    grad: Tensor,
    wants: list[bool],
) -> Grads:
    """The gradients `wants` asks for (hidden, weight, bias), `rows` vocabulary rows at a time."""
    d_hidden = _accumulator(hidden) if wants[0] else None
    d_weight = torch.empty_like(weight) if wants[1] else None
    d_bias = torch.empty_like(bias) if wants[2] and bias is not None else None
    kept, label = _labels(target, ignore)
    scale = kept * grad.float()  # d(sum)/d(each token's loss), 0 where unlabelled
    for start in range(0, weight.shape[0], rows):
        logits = _slice_logits(hidden, weight, bias, start, rows)
        end, dtype = start + logits.shape[1], logits.dtype
        d_logits = logits.float()  # softmax minus one-hot, in place on one fp32 slice
        del logits  # (an fp32 model's own: the same tensor)
        d_logits.sub_(lse.unsqueeze(1)).exp_()
        _minus_one_hot(d_logits, label, start)
        d_logits = d_logits.mul_(scale).to(dtype)  # as autograd casts it back
        if d_hidden is not None:
            d_hidden += d_logits @ weight[start:end]
        if d_weight is not None:
            d_weight[start:end] = d_logits.t() @ hidden
        if d_bias is not None:
            d_bias[start:end] = d_logits.sum(dim=0, dtype=torch.float32)
    return _cast(d_hidden, hidden), d_weight, d_bias


def _slice_logits(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, start: int, rows: int
) -> Tensor:
    """Every token's logits over the vocabulary rows [start, start + rows), in the model's dtype."""
    part = None if bias is None else bias[start : start + rows]
    return F.linear(hidden, weight[start : start + rows], part)


def _labels(target: Tensor, ignore: int) -> tuple[Tensor, Tensor]:
    """Per token (as a column): whether it is labelled; its label, 0 where it is not."""
    kept = (target != ignore).unsqueeze(1)
    return kept, torch.where(kept, target.unsqueeze(1), 0)


def _where_in(label: Tensor, start: int, width: int) -> tuple[Tensor, Tensor]:
    """Whether each token's label falls in the columns [start, start + width), and its column."""
    return (label >= start) & (label < start + width), (label - start).clamp(0, width - 1)


def _minus_one_hot(d_logits: Tensor, label: Tensor, start: int) -> None:
    """Subtract 1 at each token's label, where it falls in this piece's columns."""
    inside, at = _where_in(label, start, d_logits.shape[1])
    d_logits.scatter_add_(1, at, inside.to(d_logits.dtype).neg())


def _accumulator(tensor: Tensor) -> Tensor:
    """Zeros shaped as `tensor`, in fp32 where its dtype is narrower (bf16, fp16)."""
    wide = tensor.dtype.is_floating_point and tensor.dtype.itemsize < 4
    return torch.zeros_like(tensor, dtype=torch.float32 if wide else tensor.dtype)


def _cast(total: Tensor | None, like: Tensor | None) -> Tensor | None:
    return None if total is None or like is None else total.to(like.dtype)
