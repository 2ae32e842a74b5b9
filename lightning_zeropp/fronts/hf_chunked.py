"""An HF causal LM's head and loss in chunks on the last stage, through the model's own forward.

HF's causal LMs compute `logits = self.lm_head(hidden)` and then `self.loss_function(logits,
labels, ...)` (transformers' `ForCausalLMLoss`): the whole logits of a micro-batch exist, and its
fp32 softmax is kept for backward. `ChunkedHead.install(model)` changes two things, neither a
parameter name: the head (a plain `nn.Linear`) gets a class whose forward, while a front's
training step is `armed`, returns its input hidden states instead of the logits; and the model's
`loss_function` computes `ForCausalLMLoss` from those hidden states and the head's weight over
chunks of tokens (`core.step.chunked_loss`), with the same label shift, `ignore_index`,
`shift_labels` and `num_items_in_batch`. So the loss, its gradients and the fronts' token
weighting are those of whole logits (fp32, to round-off), and the logits never exist whole.

Only a front whose training step reads nothing but the loss arms it (the Accelerate front and
`ZeroPPTrainer` on it, with labels given): evaluation, predictions and a step that reads the
logits keep them whole. Only HF's own `ForCausalLMLoss` (read by name: nothing here imports
transformers) and a plain linear head are chunked; a model that changes the logits between its
head and its loss (Gemma-2's soft-capping) is left as it is. Under the call split only: the
engine turns chunks off under the others (`loss_chunk() == 0`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zeropp.core.step.chunked_loss import linear_cross_entropy, loss_chunk

__all__ = ["ChunkedHead", "armed", "check_consumed"]

_state = {"armed": False}
# HF config keys of models that change the logits between the head and the loss (Gemma-2's
# soft-capping, Cohere's logit_scale, Granite's logits_scaling): their logits stay whole.
_SCALED = ("final_logit_softcapping", "logit_scale", "logits_scaling")
# id(hidden states a head returned) -> (those states, the head): what the loss call looks up.
_pending: dict[int, tuple[torch.Tensor, nn.Linear]] = {}


@contextlib.contextmanager
def armed(on: bool = True) -> Iterator[None]:
    """While active (around a training step whose calls carry labels): the installed heads hand
    their hidden states to the chunked loss instead of computing logits."""
    before, _state["armed"] = _state["armed"], on
    try:
        yield
    finally:
        _state["armed"] = before
        _pending.clear()


def check_consumed() -> None:
    """After a micro-batch's forward on the last stage: its head's hidden states went to the
    chunked loss; a forward that read them as logits instead is named, never trained on."""
    if _pending:
        _pending.clear()
        raise RuntimeError(
            "the model's head was computed in chunks with its loss (loss_chunk), but its forward "
            "did not pass the head's output to its loss_function: set loss_chunk=0."
        )


class _DeferredHead(nn.Linear):
    """A linear head whose logits, when armed in training, are left to the chunked loss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # On the meta device (the shape a stage's stand-in for a head held elsewhere returns):
        # the logits' shape, as before.
        live = _state["armed"] and self.training and torch.is_grad_enabled() and loss_chunk()
        if not live or x.device.type == "meta":
            return F.linear(x, self.weight, self.bias)
        _pending[id(x)] = (x, self)
        return x


def _is_causal_lm_loss(fn: Any) -> bool:
    return getattr(fn, "__name__", "") == "ForCausalLMLoss" and str(
        getattr(fn, "__module__", "")
    ).startswith("transformers.")


class ChunkedHead:
    """Installs the chunked head and loss on an HF causal LM (`install`); see the module."""

    @staticmethod
    def eligible(model: nn.Module) -> tuple[Any, nn.Linear] | None:
        """The module whose class defines the loss and its head, where `install` would compute
        them in chunks (a plain linear output embedding, HF's `ForCausalLMLoss` and the HF
        class's own forward, no logit soft-capping); else None. Changes nothing: the planner
        asks it too, to price the head and loss as the run computes them."""
        # PEFT wraps the HF model: the module whose class defines the loss is the one to change
        owner: Any = next(  # Any: loss_function is HF's, unknown to nn.Module
            (
                m
                for m in model.modules()
                if any("loss_function" in vars(cls) for cls in type(m).__mro__)
            ),
            None,
        )
        get_head = getattr(owner, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        config = getattr(owner, "config", None)
        if owner is None or type(head) is not nn.Linear or config is None:
            return None
        if any(getattr(config, key, None) not in (None, 1, 1.0) for key in _SCALED):
            return None  # the logits are changed between the head and the loss
        if not _is_causal_lm_loss(owner.loss_function) or not _forward_feeds_the_loss(owner):
            return None
        return owner, head

    @staticmethod
    def install(model: nn.Module) -> bool:
        """Whether `model`'s head and loss now compute in chunks when armed (`eligible`); else
        unchanged."""
        found = ChunkedHead.eligible(model)
        if found is None:
            return False
        owner, head = found
        inner = owner.loss_function
        head.__class__ = _DeferredHead

        def chunked(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **kw: Any) -> Any:
            found = _pending.pop(id(logits), None)
            if found is None or found[0] is not logits:
                if _pending:
                    raise RuntimeError(
                        f"{type(owner).__name__} changed its head's output before its loss; the "
                        "head and the loss cannot be computed in chunks: set loss_chunk=0."
                    )
                return inner(logits, labels, vocab_size, **kw)
            return _causal_lm_loss(logits, found[1], labels, **kw)

        owner.loss_function = chunked  # HF's property has a setter
        return True


def _forward_feeds_the_loss(owner: nn.Module) -> bool:
    """Whether the model's forward is its HF class's own (which, given labels, hands its head's
    output to its loss function), not a subclass's that may read the logits itself; a forward
    that still does is named at its first step (`check_consumed`)."""
    forward = getattr(type(owner), "forward", None)
    return str(getattr(forward, "__module__", "")).startswith("transformers.")


def _causal_lm_loss(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **_: Any,
) -> torch.Tensor:
    """transformers' `ForCausalLMLoss` (shift, `ignore_index`, sum over `num_items_in_batch` or
    the labelled tokens' mean) on `head(hidden)`, in chunks."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.reshape(-1).to(hidden.device)
    total = linear_cross_entropy(
        hidden, head.weight, head.bias, shift_labels, ignore_index=ignore_index
    )
    if num_items_in_batch is None:  # HF's mean: over the labelled tokens
        return total / (shift_labels != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
