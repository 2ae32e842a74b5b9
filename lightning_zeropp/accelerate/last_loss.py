"""A user's loss on the last stage in the Accelerate front (`PipelineModel.use_loss`).

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.use_loss(my_loss)          # my_loss(output, labels, num_items_in_batch=n, **rows)
    out = model(**batch)             # runs the pipeline step; my_loss runs on the last stage
    accelerator.backward(out.loss)
    accelerator.log({"loss": out.loss.item(), **out.metrics})

A training call returns only the loss (the logits exist on the last stage, one micro-batch at a
time): a loss from the logits must be computed there, per micro-batch. The call takes the labels
out of the model's inputs (the model computes no loss of its own, as transformers' Trainer calls
a model under `compute_loss_func`), counts the global batch's labels and runs the core's
`LastLossStep` as the engine's loss (`core.step.last_loss`: the contract and the weighting).
Forward only, the labels of the samples Accelerate repeated to complete a short last batch are
masked first (`repeats`): every process gets the global batch's loss, which one process computes
without them. Under context parallelism the last stage's output is gathered into whole sequences
on every CP rank (`core.step.context_attention.whole_sequences`) and the loss is given the whole
labels: each CP rank computes the whole loss, whose gradient the gather's backward sums over the
CP ranks and the engine's mean over them divides back, as in the Lightning front.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from accelerate.state import GradientState

from lightning_zeropp.accelerate.outputs import broadcast_logits
from lightning_zeropp.accelerate.repeats import without_repeated_rows
from lightning_zeropp.core.step.last_loss import (
    LastLossStep,
    LastStageLoss,
    global_items,
    share_metrics,
)
from lightning_zeropp.fronts.hf_loss import NUM_ITEMS
from lightning_zeropp.fronts.microbatches import call_microbatches, loss_shares
from lightning_zeropp.fronts.packing import Reshaped, reshape

if TYPE_CHECKING:
    from lightning_zeropp.accelerate.steps import PipelineModel, PipelineOutput

__all__ = ["LastStageLoss", "run_with_loss"]


def run_with_loss(
    pipeline: PipelineModel, kwargs: dict[str, Any], output_type: type[PipelineOutput]
) -> PipelineOutput:
    """One call of the pipelined model whose loss is `pipeline.last_loss`: a training step
    (forward and backward) in training mode, else forward only (with the logits when asked).

    `num_items_in_batch` in `kwargs` is the caller's count per micro-batch and data-parallel
    rank (the Trainer's over its accumulation window); else the global batch's labels are
    counted (a collective over data-parallel ranks)."""
    loss = pipeline.last_loss
    assert loss is not None
    kwargs = dict(kwargs)
    missing = [name for name in loss.rows if not isinstance(kwargs.get(name), torch.Tensor)]
    if missing:
        raise ValueError(
            f"the last-stage loss reads the batch's per-row tensors {list(loss.rows)}, but the "
            f"batch has no tensor {missing} (keys: {sorted(kwargs)})"
        )
    # The model is still called with them: the split checked its call on a batch of the same
    # loader, and HF models hand unknown keywords down to every block.
    training = pipeline.training and torch.is_grad_enabled()
    if not training and loss.group == 1:
        # every process gets the global batch's loss: the samples Accelerate repeated to
        # complete a short last batch count in it no more than one process sees them (a
        # grouped loss, pairs, masks its own: the rows of a sample are its to know)
        dims = pipeline.engine.dims
        kwargs = without_repeated_rows(kwargs, GradientState(), dims.dp_rank, dims.dp_size)
    rows = {name: kwargs[name] for name in loss.rows}
    shaped = _reshaped(pipeline, loss, kwargs)
    kwargs = dict(shaped.batch)
    target = kwargs.pop("labels", None)
    if not isinstance(target, torch.Tensor):
        raise ValueError(
            "a call of the pipelined model with a last-stage loss (use_loss) needs labels=...: "
            "the loss runs on the last stage with each micro-batch's labels"
        )
    given = kwargs.pop(NUM_ITEMS, None)
    core, dims = pipeline.engine.core, pipeline.engine.dims
    pipeline.rows = rows_of(kwargs)
    # forward only: as many micro-batches as split the groups (pairs), which the caller checked
    units = pipeline.rows // loss.group if training is False else pipeline.rows
    micro = call_microbatches(units, core.config.num_microbatches, training)
    if given is not None:
        items = float(given)
    else:
        # under CP every CP rank computes the whole micro-batch's loss (whole sequences):
        # the engine's mean over equal CP values keeps them, so the CP ranks are no shares
        shares = loss_shares(micro, dims, cp_parts=False)
        items = global_items(loss, target, shares, dims.dp_groups, core.device)
    if core.config.cp_size > 1:
        # the blocks are called as the split checked them, on a batch with labels, which the
        # CP split gives the model as `shift_labels` too (HF hands them down to every block);
        # without `labels` the model computes no loss of its own
        kwargs["shift_labels"] = pipeline._context_target(target)
    if pipeline.token_weighted:
        # the call reaches the blocks as the split checked it: with the count (it computes no
        # loss without labels, so the model reads nothing of it)
        kwargs[NUM_ITEMS] = items
    # under CP the loss sees whole sequences and whole, unshifted labels (`steps.loss_fn`)
    step = LastLossStep(loss, items, micro, target, rows, whole=core.config.cp_size > 1)
    out = output_type()
    pipeline._last_step = step
    try:
        if training:
            value, grads = core.train_step_deferred(target=target, **kwargs)
            if pipeline.stopper is not None:
                pipeline.stopper.batches += 1
            leaf = value.detach().clone().requires_grad_()
            # as PipelineModel._train: the loop's backward scales this step's gradients
            leaf.register_hook(lambda grad: grads.apply(grad))
            out["loss"] = leaf
        else:
            pipeline._captured = [] if pipeline.eval_logits else None
            with torch.no_grad():
                out["loss"] = core.eval_step(target=target, microbatches=micro, **kwargs)
            logits = broadcast_logits(core, pipeline._captured) if pipeline.eval_logits else None
            if logits is not None:
                out["logits"] = shaped.restore(logits)
        dims_pp = dims.pp_group if core.config.pp_size > 1 else None
        out.metrics = share_metrics(
            step.metrics,
            core.device,
            dims_pp,
            core.config.pp_size,
            core.last_pp_rank,
            dims.dp_groups,
            dims.dp_size,
        )
    finally:
        pipeline._last_step = None
        pipeline._captured = None
    return out


def _reshaped(pipeline: PipelineModel, loss: LastStageLoss, kwargs: dict[str, Any]) -> Reshaped:
    """Packed rows regrouped for the micro-batches (`fronts.packing`) only where that changes no
    number: a causal LM's rows, a loss that skips each row's first label, no per-row tensors."""
    if not (pipeline.shifts and loss.shift == 1 and not loss.rows):
        return Reshaped(kwargs)
    assert pipeline.engine.core.config.num_microbatches is not None
    return reshape(kwargs, pipeline.engine.core.config.num_microbatches, pipeline.seq_buckets)


def rows_of(kwargs: dict[str, Any]) -> int:
    for value in kwargs.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise ValueError("the model was called without any batched tensor (input_ids=...)")
