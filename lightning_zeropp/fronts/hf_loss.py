"""HF models' loss conventions, shared by the fronts: token-weighted losses and the KV cache.

HF models mark positions without a target with -100 and average their loss over the labelled
tokens of whatever batch they see. Under a pipeline they see one micro-batch at a time, and the
mean of micro-batch means is not the batch's token mean when micro-batches hold different numbers
of labelled tokens (padding). HF's own remedy, `num_items_in_batch` (the divisor of the summed
loss, which transformers' Trainer passes for gradient accumulation), is used here too.

Which labels count is the model's business, so it is observed, not looked up by class name:
`token_rule(model)` calls the model's own `loss_function` on a tiny synthetic case (zero logits,
one labelled position at a time: each counted token adds log(vocab) to the summed loss) and reads
how many leading labels of a row are never targets (1 for causal LMs, which shift inside the
loss, whatever the class is called). Whether a model's forward really computes its loss so, and
what is done when it does not, is `fronts.loss_rule`'s (`LossWatch`, `TokenCountAdapter`).
Duck-typed: nothing here imports transformers.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "IGNORE_INDEX",
    "NUM_ITEMS",
    "TokenRule",
    "accepts_num_items",
    "disable_kv_cache",
    "token_counts",
    "token_rule",
]

IGNORE_INDEX = -100  # HF's label for "no loss here" (padding, prompts)
NUM_ITEMS = "num_items_in_batch"  # HF's keyword: divide the summed token loss by this
_PROBE_VOCAB, _PROBE_LEN = 4, 5  # the synthetic case: zero logits over 4 classes, 5 positions


def accepts_num_items(model: nn.Module) -> bool:
    """Whether `model`'s forward can hand `num_items_in_batch` to its `loss_function` (HF
    models whose forward passes its keyword arguments on: the test transformers' Trainer makes)."""
    flag = getattr(model, "accepts_loss_kwargs", None)
    if isinstance(flag, bool):
        return flag and hasattr(model, "loss_function")
    params = inspect.signature(model.forward).parameters.values()
    takes = any(p.kind is inspect.Parameter.VAR_KEYWORD or p.name == NUM_ITEMS for p in params)
    return takes and hasattr(model, "loss_function")


@dataclass(frozen=True)
class TokenRule:
    """How a model's loss counts labelled tokens, as observed from its `loss_function`.

    `shift`: leading labels of each row of `labels` that are never targets (1: a causal LM's
    position t predicts token t+1); `pre_shift`: the same for `shift_labels` when the loss
    reads them instead (0 for HF's causal LM loss), None when it ignores them."""

    shift: int
    pre_shift: int | None = None

    @property
    def causal(self) -> bool:
        """A causal LM's rule: position t predicts token t+1, so each row's first label is
        never a target (what makes padding a row or regrouping packed rows exact)."""
        return self.shift == 1

    def counts(
        self, labels: torch.Tensor, micro: int, shift_labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Labelled tokens in each of `micro` equal row blocks of the batch (fp64)."""
        if shift_labels is not None and self.pre_shift is not None:
            return token_counts(shift_labels, micro, self.pre_shift)
        return token_counts(labels, micro, self.shift)


def token_counts(labels: torch.Tensor, micro: int, shift: int) -> torch.Tensor:
    """Labels other than -100, past the first `shift` of each row, in each of `micro` equal row
    blocks of `labels` (fp64)."""
    rows = labels[..., int(shift) :] if labels.dim() >= 2 else labels
    per_row = (rows != IGNORE_INDEX).reshape(rows.shape[0], -1).sum(dim=1)
    return per_row.reshape(micro, -1).sum(dim=1).to(torch.float64)


def token_rule(model: nn.Module) -> TokenRule | None:
    """The model's token-counting rule, read from its own `loss_function` on a synthetic case;
    None when its forward cannot take `num_items_in_batch` or its loss does not behave as a sum
    of per-token losses divided by it (then the fronts cannot weigh micro-batches by tokens)."""
    if not accepts_num_items(model):
        return None
    loss_function = getattr(model, "loss_function", None)
    if not callable(loss_function):
        return None
    shift = _leading_skipped(loss_function, "labels")
    if shift is None or shift == _PROBE_LEN:
        return None
    pre_shift = _leading_skipped(loss_function, "shift_labels")
    return TokenRule(shift, None if pre_shift == _PROBE_LEN else pre_shift)


def _leading_skipped(loss_function: Callable[..., Any], key: str) -> int | None:
    """How many leading positions of `key` the loss never counts, if what it counts is every
    labelled position from there on and it divides its sum by `num_items_in_batch`."""
    length, unit = _PROBE_LEN, math.log(_PROBE_VOCAB)
    counted = []
    for position in [*range(length), None]:  # None: every position labelled
        labels = torch.ones(1, length, dtype=torch.long)
        if position is not None:
            labels.fill_(IGNORE_INDEX)[0, position] = 1
        value = _probe_loss(loss_function, key, labels, 1.0)
        if value is None or abs(value / unit - round(value / unit)) > 1e-3:
            return None
        counted.append(round(value / unit))
    *single, total = counted
    skipped = next((i for i, c in enumerate(single) if c), length)
    if single != [0] * skipped + [1] * (length - skipped) or total != length - skipped:
        return None
    halved = _probe_loss(loss_function, key, torch.ones(1, length, dtype=torch.long), 2.0)
    if halved is None or not math.isclose(2 * halved, total * unit, rel_tol=1e-4, abs_tol=1e-6):
        return None  # the divisor is not honoured
    return skipped


def _probe_loss(
    loss_function: Callable[..., Any], key: str, labels: torch.Tensor, items: float
) -> float | None:
    kwargs = {"labels": labels}
    if key == "shift_labels":
        kwargs = {"labels": torch.full_like(labels, IGNORE_INDEX), "shift_labels": labels}
    logits = torch.zeros(1, labels.shape[1], _PROBE_VOCAB)
    try:
        with torch.no_grad():
            loss = loss_function(
                logits=logits, vocab_size=_PROBE_VOCAB, **{NUM_ITEMS: items}, **kwargs
            )
        return float(loss)
    except Exception:  # a loss of another shape or signature: not one this can read
        return None


def disable_kv_cache(model: nn.Module) -> None:
    """Turn off an HF model's KV cache, which its forward builds even in training unless told
    not to (as transformers' Trainer does under gradient checkpointing): a pipeline stage
    returns tensors only. Duck-typed, so calling it on any model is harmless; both fronts call
    it on the model they are given."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False
