"""The model passed to `ZeroPPTrainer`, once the pipeline is built: its weights live in the
stages, so the model object is released (its parameters moved to the meta device) and a read of
its state dict (`model.save_pretrained(dir)`, the usual closing line of a PEFT script) is refused
with what to use instead, rather than failing on a meta tensor or writing a stale copy.

At pp_size=1 the model is itself the pipeline's one stage, sharded in place: its state dict is
what the pipeline's checkpoints read, so it stays readable, and its `save_pretrained` is refused
instead (it would write one rank's shards: rank 0 failed with "invalid python storage" while
another rank wrote its own shard), with the same words, on every rank that calls it."""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["release_weights"]


def release_weights(model: nn.Module, kept: nn.Module | None = None) -> None:
    """Move `model`'s parameters to the meta device, in place (tied ones stay tied): its
    weights were copied into the stages, which train; the model's would go stale.

    `kept`: the pipeline's modules. What they hold is no copy but the trained weights (a
    single stage is the model itself, sharded in place), so it stays, and its modules' state
    dicts stay readable (the pipeline's checkpoints and `save_model` read them)."""
    held = {id(p) for p in kept.parameters()} if kept is not None else set()
    in_pipeline = {id(m) for m in kept.modules()} if kept is not None else set()
    released: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device.type == "meta" or id(param) in held:
                continue
            if id(param) not in released:
                meta = torch.empty_like(param, device="meta")
                released[id(param)] = nn.Parameter(meta, requires_grad=param.requires_grad)
            module._parameters[name] = released[id(param)]
    for module in model.modules():  # the model, and the HF model inside a PeftModel
        if not (module is model or callable(getattr(module, "save_pretrained", None))):
            continue
        if id(module) not in in_pipeline:
            module.register_state_dict_pre_hook(_refuse_released)
        elif callable(getattr(module, "save_pretrained", None)):  # the stage itself (pp_size=1)
            # on the instance (a plain attribute: not a tensor or module for nn.Module to track)
            refusing = types.MethodType(_refusing_save_pretrained, module)
            object.__setattr__(module, "save_pretrained", refusing)


_INSTEAD = (
    "Use trainer.save_model(dir) (an HF directory; the adapter only for a PEFT model), or "
    "whole = trainer.accelerator.unwrap_model(trainer.model_wrapped) on every rank, then "
    "whole.save_pretrained(dir) / whole.merge_and_unload() on the main process."
)
_RELEASED = (
    "this model's weights moved into the pipeline's stages when ZeroPPTrainer built it (its "
    "parameters are on the meta device now), so it has no weights to save or read. " + _INSTEAD
)
_SHARDED = (
    "this model is the pipeline's only stage (pp_size=1), sharded in place over the "
    "data-parallel ranks when ZeroPPTrainer built it: each rank holds only its shards of the "
    "weights, so model.save_pretrained(dir) would write one rank's shards, not the model. "
    + _INSTEAD
)


def _refusing_save_pretrained(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`save_pretrained` of the model that is the pipeline's one stage: refused while its weights
    are shards (every rank; before anything is written); with a `state_dict` given (what
    `trainer.save_model` passes, gathered) or once `unwrap_model` has put the whole weights
    back (the main process), the model's own."""
    own: Any = type(self)  # the class's method, under the one shadowing it here
    sharded = any(isinstance(p, DTensor) or p.device.type == "meta" for p in self.parameters())
    if sharded and _given_state_dict(own.save_pretrained, self, args, kwargs) is None:
        raise RuntimeError(_SHARDED)
    return own.save_pretrained(self, *args, **kwargs)


def _given_state_dict(method: Any, model: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
    """The `state_dict` a call of `method` passes, by keyword or by position (the third
    parameter of HF's `save_pretrained(save_directory, is_main_process, state_dict, ...)`)."""
    try:
        return inspect.signature(method).bind(model, *args, **kwargs).arguments.get("state_dict")
    except TypeError:  # a call the method would refuse anyway: the keyword only
        return kwargs.get("state_dict")


def _refuse_released(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """A state dict of the released model (`model.save_pretrained(dir)`, the usual closing line
    of a PEFT script) says what to use instead of failing on a meta tensor; once
    `unwrap_model` has put the trained weights back (the main process), it is the model's."""
    if any(p.device.type == "meta" for p in module.parameters()):
        raise RuntimeError(_RELEASED)
