"""HF models' loss conventions, shared by both fronts: token-weighted losses and the KV cache.

HF causal LMs mark positions without a target with -100 and average their loss over the labelled
tokens of whatever batch they see. Under a pipeline they see one micro-batch at a time, and the
mean of micro-batch means is not the batch's token mean when micro-batches hold different numbers
of labelled tokens (padding). HF's own remedy, `num_items_in_batch` (the divisor of the summed
loss, which transformers' Trainer passes for gradient accumulation), is used here too.
Duck-typed: nothing here imports transformers.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from lightning_zeropp.core.split.call_adapter import CallAdapter

__all__ = [
    "IGNORE_INDEX",
    "NUM_ITEMS",
    "TokenCountAdapter",
    "accepts_num_items",
    "disable_kv_cache",
    "is_causal_lm",
    "token_counts",
]

IGNORE_INDEX = -100  # HF's label for "no loss here" (padding, prompts)
NUM_ITEMS = "num_items_in_batch"  # HF's keyword: divide the summed token loss by this


def accepts_num_items(model: nn.Module) -> bool:
    """Whether `model`'s loss honours `num_items_in_batch` (HF models whose forward passes its
    keyword arguments on to `loss_function`: the test transformers' Trainer makes)."""
    flag = getattr(model, "accepts_loss_kwargs", None)
    if isinstance(flag, bool):
        return flag and hasattr(model, "loss_function")
    params = inspect.signature(model.forward).parameters.values()
    takes = any(p.kind is inspect.Parameter.VAR_KEYWORD or p.name == NUM_ITEMS for p in params)
    return takes and hasattr(model, "loss_function")


def is_causal_lm(model: nn.Module) -> bool:
    """Causal LMs predict token t+1 at t: the first label of a row is never a target."""
    loss_type = getattr(model, "loss_type", None)
    return loss_type == "ForCausalLM" or type(model).__name__.endswith("ForCausalLM")


def token_counts(labels: torch.Tensor, micro: int, shift: bool) -> torch.Tensor:
    """Labelled tokens in each of `micro` equal row blocks of `labels` (fp64); `shift`: the
    first label of every row is no target (causal LMs, labels not pre-shifted)."""
    rows = labels[..., 1:] if shift and labels.dim() >= 2 else labels
    per_row = (rows != IGNORE_INDEX).reshape(rows.shape[0], -1).sum(dim=1)
    return per_row.reshape(micro, -1).sum(dim=1).to(torch.float64)


class TokenCountAdapter(CallAdapter):
    """Makes a padded batch's loss the mean over its labelled tokens, as one process computes
    it, not the mean of micro-batch means (which weighs a token of a short micro-batch more).

    For a model whose loss takes `num_items_in_batch`: a call with `labels=` gets
    `num_items_in_batch = tokens / microbatches`, so each micro-batch's loss is its token sum
    times `microbatches / tokens`, and the pipeline's mean over micro-batches is the batch's
    token mean. `microbatches` is set by the front before each call.
    """

    def __init__(self, shift: bool) -> None:
        self.shift = shift
        self.microbatches = 1

    def stage_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        labels = kwargs.get("labels")
        if not isinstance(labels, torch.Tensor) or NUM_ITEMS in kwargs:
            return args, kwargs
        pre = kwargs.get("shift_labels")
        counted = pre if isinstance(pre, torch.Tensor) else labels
        shift = self.shift and not isinstance(pre, torch.Tensor)
        total = float(token_counts(counted, 1, shift).sum())
        if total == 0:
            raise ValueError("the batch has no labelled token (every label is -100)")
        return args, {**kwargs, NUM_ITEMS: total / self.microbatches}


def disable_kv_cache(model: nn.Module) -> None:
    """Turn off an HF model's KV cache, which its forward builds even in training unless told
    not to (as transformers' Trainer does under gradient checkpointing): a pipeline stage
    returns tensors only. Duck-typed, so calling it on any model is harmless; both fronts call
    it on the model they are given."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False
