"""The model `ZeroPPAccelerator.prepare` returns: `model(**batch)` runs a whole pipeline step.

A pipeline cannot run the forward now and the backward later, when the loop calls
`accelerator.backward(loss)`: the schedule interleaves both over the micro-batches. So in
training mode the call runs forward and backward of the whole batch (as Accelerate's Megatron-LM
integration does), and returns an output whose `.loss` is the global-batch loss `L`, a leaf
tensor that requires grad. What the loop does with it keeps its meaning: when its backward
reaches that leaf with the gradient `c = d(what the loop differentiates) / dL` (1 for
`backward(loss)`, `1/k` for Accelerate's accumulation scaling, anything for a transformed loss),
the step's gradients are added to `.grad` times `c`, as autograd would add them in one process.
A step that is never backpropagated adds nothing.

The loss is the mean over the global batch's real tokens: for a model whose forward takes HF's
`num_items_in_batch` (every HF causal LM does), each micro-batch's loss is its token sum divided by
the global count (times the micro-batch and data-parallel counts the engine averages over). For
other models the loss is the mean of micro-batch means, which equals the global mean only when
every micro-batch has as many labelled tokens: a batch where they differ is refused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_zeropp.accelerate.engine import ZeroPPAccelerateEngine
from lightning_zeropp.core.schedule.build import eval_microbatches
from lightning_zeropp.core.step.failure import guarded
from lightning_zeropp.models.hf_loss import (
    NUM_ITEMS,
    accepts_num_items,
    is_causal_lm,
    token_counts,
)

__all__ = [
    "NUM_ITEMS",
    "PipelineModel",
    "PipelineOutput",
    "accepts_num_items",
    "loss_of",
]


class PipelineOutput(dict):
    """What `model(**batch)` returns: `.loss` (and `.logits` in eval mode), also as keys, and
    by position as HF's `ModelOutput` (`output[0]` is the loss)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

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


class PipelineModel(nn.Module):
    """This rank's pipeline stages, called like the model they came from.

    `parameters()` are this rank's (sharded) parameters under the model's own names, so
    `accelerator.clip_grad_norm_(model.parameters(), ...)` and parameter-group code work;
    `train()` / `eval()` switch the stages. `engine` is the `ZeroPPAccelerateEngine`.
    """

    def __init__(self, engine: ZeroPPAccelerateEngine, original: nn.Module) -> None:
        super().__init__()
        self.module = engine.module
        object.__setattr__(self, "engine", engine)
        # The user's model, for unwrap_model (not a submodule: its weights are not ours).
        object.__setattr__(self, "original", original)
        self.token_weighted = accepts_num_items(original)
        # Causal LMs predict token t+1 at t: the first label of a row is never a target.
        self.shifts = is_causal_lm(original)
        self.eval_logits = True
        self._captured: list[Any] | None = None

    # ---------------------------------------------------------------- calls
    @guarded  # token counts and logits are collectives too: a lost rank is named
    def forward(self, *args: Any, **kwargs: Any) -> PipelineOutput:
        target = _target_of(args, kwargs)
        if self.training and torch.is_grad_enabled():
            if target is None:
                raise ValueError(
                    "a training call of the pipelined model needs labels (labels=...): the "
                    "pipeline computes the loss inside the call and runs the backward with it."
                )
            return self._train(args, kwargs, target)
        return self._eval(args, kwargs, target)

    def _train(self, args: Any, kwargs: dict[str, Any], target: torch.Tensor) -> PipelineOutput:
        core = self.engine.core
        assert core.config.num_microbatches is not None
        kwargs = self._weighted(kwargs, target, core.config.num_microbatches)
        loss, grads = core.train_step_deferred(*args, target=target, **kwargs)
        leaf = loss.detach().clone().requires_grad_()
        # The loop's backward reaches the loss with d(what it differentiates)/dL: this step's
        # gradients go to .grad times that (on the device: no host sync).
        leaf.register_hook(lambda grad: grads.apply(grad))
        return PipelineOutput(loss=leaf)

    @torch.no_grad()
    def _eval(self, args: Any, kwargs: dict[str, Any], target: torch.Tensor | None) -> Any:
        core = self.engine.core
        assert core.config.num_microbatches is not None
        rows = _rows(args, kwargs)
        if target is None and self.token_weighted:
            # No loss to weigh, but every call must reach the blocks alike (HF hands its keyword
            # arguments down to them): the split checked a call carrying the count.
            kwargs = {NUM_ITEMS: 1.0, **kwargs}
        if target is not None:
            kwargs = self._weighted(
                kwargs, target, eval_microbatches(rows, core.config.num_microbatches)
            )
        self._captured = [] if self.eval_logits else None
        try:
            loss = core.eval_step(
                *args, target=target if target is not None else _any_tensor(args, kwargs), **kwargs
            )
            logits = self._broadcast_logits() if self.eval_logits else None
        finally:
            self._captured = None
        out = PipelineOutput()
        if target is not None:
            out["loss"] = loss
        if logits is not None:
            out["logits"] = logits
        return out

    # ---------------------------------------------------------------- the engine's loss
    def loss_fn(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """Per micro-batch, on the last stage: the model's own loss (already weighted by
        `num_items_in_batch` when the model takes it); keeps the logits in eval mode."""
        if self._captured is not None:
            logits = (
                output.get("logits") if hasattr(output, "get") else getattr(output, "logits", None)
            )
            if logits is None and isinstance(output, torch.Tensor) and output.dim() > 0:
                logits = output
            self._captured.append(logits)
        loss = loss_of(output)
        if loss is None:
            if not torch.is_grad_enabled() and self._captured is not None:
                return torch.zeros((), device=target.device)
            raise ValueError(
                f"the model returned {type(output).__name__} without a loss: under "
                "ZeroPPAccelerator the model call computes the loss (HF models do when given "
                "labels=...). For a loss computed outside the model, use prepare_pipeline(..., "
                "loss_fn=...)."
            )
        return loss

    # ---------------------------------------------------------------- token weighting
    def _weighted(self, kwargs: dict[str, Any], target: torch.Tensor, micro: int) -> dict[str, Any]:
        """`kwargs` with `num_items_in_batch` set so that the engine's mean over micro-batches
        and data-parallel ranks is the mean over the global batch's labelled tokens."""
        if NUM_ITEMS in kwargs:
            return kwargs  # the loop chose its own normalisation
        labels = kwargs.get("shift_labels")
        shifted = labels is not None
        labels = labels if shifted else target
        counts = token_counts(labels, micro, self.shifts and not shifted).to(self.engine.device)
        dims = self.engine.dims
        total = counts.sum()
        low, high = counts.min().clone(), counts.max().clone()
        for group in dims.dp_groups:
            dist.all_reduce(total, group=group)
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        if self.token_weighted:
            if int(total) == 0:
                raise ValueError("the global batch has no labelled token (every label is -100)")
            return {**kwargs, NUM_ITEMS: float(total) / (micro * dims.dp_size)}
        if int(low) != int(high):
            raise ValueError(
                f"micro-batches of this batch hold between {int(low)} and {int(high)} labelled "
                f"tokens, and {type(self.original).__name__}'s forward does not take "
                "num_items_in_batch: its per-micro-batch mean losses would not average to the "
                "batch's token mean. Accept num_items_in_batch (divide the summed loss by it), "
                "or pass batches whose micro-batches hold equal numbers of labelled tokens."
            )
        return kwargs

    def _broadcast_logits(self) -> torch.Tensor | None:
        """The last stage's logits for the whole batch, on every rank of the pipeline."""
        core = self.engine.core
        captured = self._captured or []
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


# ------------------------------------------------------------------------------------ helpers
def _target_of(args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    labels = kwargs.get("labels")
    return labels if isinstance(labels, torch.Tensor) else None


def _rows(args: Any, kwargs: dict[str, Any]) -> int:
    tensor = _any_tensor(args, kwargs)
    return tensor.shape[0]


def _any_tensor(args: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value
    raise ValueError("the model was called without any batched tensor (input_ids=...)")
