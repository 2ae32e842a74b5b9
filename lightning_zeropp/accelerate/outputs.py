"""What a call of the pipelined model (`PipelineModel`) returns, and what it reads of the call:
`PipelineOutput` (`.loss`, `.logits` in eval mode, by key and by position as HF's `ModelOutput`),
the loss in a model's own output (`loss_of`), the labels and rows of a call, and the last stage's
logits broadcast to every rank of the pipeline."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "TRAINING_ONLY_LOSS",
    "PipelineOutput",
    "any_tensor",
    "broadcast_logits",
    "call_rows",
    "loss_of",
    "target_of",
]


class PipelineOutput(dict):
    """What `model(**batch)` returns: `.loss` (and `.logits` in eval mode), also as keys, and
    by position as HF's `ModelOutput` (`output[0]` is the loss)."""

    _hint = ""  # why a field the model's own output would have is not here

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A last-stage loss's metrics (`use_loss`), the same on every rank; not a key, so the
        # Trainer does not read them as logits.
        self.metrics: dict[str, float] = {}

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            hint = f": {self._hint}" if self._hint and not name.startswith("_") else ""
            raise AttributeError(f"{name}{hint}") from None

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int):
            return list(self.values())[key]
        return super().__getitem__(key)

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(self.values())


def loss_of(output: Any) -> torch.Tensor | None:
    """The loss in a model's output: `.loss`, `["loss"]`, or a scalar first element."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else None
    if isinstance(output, dict) or hasattr(output, "keys"):
        return output.get("loss") if hasattr(output, "get") else None
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, (tuple, list)) and output:
        first = output[0]
        loss = first if isinstance(first, torch.Tensor) and first.dim() == 0 else None
    return loss


TRAINING_ONLY_LOSS = (
    "a training call of the pipelined model returns the global batch's loss only (the logits "
    "exist on the last pipeline stage, one micro-batch at a time, and are freed there). For "
    "logits, call the model in eval mode (model.eval(), under torch.no_grad()): that output holds "
    "the batch's .logits on every rank."
)


def target_of(args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    labels = kwargs.get("labels")
    return labels if isinstance(labels, torch.Tensor) else None


def call_rows(args: Any, kwargs: dict[str, Any]) -> int:
    tensor = any_tensor(args, kwargs)
    return tensor.shape[0]


def any_tensor(args: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value
    raise ValueError("the model was called without any batched tensor (input_ids=...)")


def broadcast_logits(core: Any, captured: list[Any] | None) -> torch.Tensor | None:
    """The last stage's logits for the whole batch (`captured`, one per micro-batch, on the last
    stage), on every rank of the pipeline."""
    captured = captured or []
    logits = torch.cat(captured) if captured and all(t is not None for t in captured) else None
    if core.config.pp_size == 1:
        return logits
    meta = [(tuple(logits.shape), logits.dtype) if logits is not None else None]
    group = core.dims.pp_group
    dist.broadcast_object_list(meta, group=group, group_src=core.last_pp_rank)
    if meta[0] is None:
        return None
    shape, dtype = meta[0]
    if logits is None:
        logits = torch.empty(shape, dtype=dtype, device=core.device)
    dist.broadcast(logits, group=group, group_src=core.last_pp_rank)
    return logits
