"""How a front turns a user's call of the pipelined model into stage inputs and back.

Fronts that keep the user's training code (the Lightning strategy) redirect the user's
`model(*args, **kwargs)`: on the first stage the call's arguments become the pipeline's inputs, on
the last stage the call returns what the pipeline produced for that micro-batch. By default both
directions are the identity. Some models take arguments the traced forward must not see and return
richer objects than a stage can send; HF causal LMs take `labels=` and return an object with
`.logits` and `.loss`. Such a model carries a `CallAdapter` (attached with `set_call_adapter`), and
the front asks for it with `get_call_adapter` before the model is split. One mechanism, no model
special cases in the fronts.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["CallAdapter", "get_call_adapter", "set_call_adapter"]

# A plain instance attribute: it is neither a parameter nor a buffer, so state dicts, checkpoints
# and parameter names are untouched.
_ATTR = "zeropp_call_adapter"


class CallAdapter:
    """The identity adapter; subclass it to change either direction."""

    # How many micro-batches the call being adapted is split into (the front sets it before
    # each call): a loss normalised over the whole batch needs it.
    microbatches: int = 1

    def stage_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The first stage's inputs, from the arguments of the user's call (whole batch)."""
        return args, kwargs

    def stage_output(self, output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What the user's call returns on the last stage, given the stage's output for one
        micro-batch and the arguments of the user's call on that micro-batch."""
        return output


def set_call_adapter(model: nn.Module, adapter: CallAdapter) -> nn.Module:
    """Attach `adapter` to `model` (returned, for chaining)."""
    if not isinstance(adapter, CallAdapter):
        raise TypeError(
            f"adapter must be a lightning_zeropp.fronts.call_adapter.CallAdapter, got "
            f"{type(adapter).__name__}; subclass CallAdapter."
        )
    # object.__setattr__: nn.Module.__setattr__ would accept it too, but this keeps the intent
    # (an annotation of the instance, not part of the module tree) explicit.
    object.__setattr__(model, _ATTR, adapter)
    return model


def get_call_adapter(model: nn.Module) -> CallAdapter:
    """The adapter attached to `model`, or the identity."""
    return getattr(model, _ATTR, None) or CallAdapter()
