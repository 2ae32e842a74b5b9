"""The losses `ZeroPPTrainer.compute_loss` returns, as one process computes them: the pipeline's
loss of the global batch in training (divided by the Trainer's token count of its accumulation
window), the Trainer's own loss run on the last stage (`compute_loss_func`, label smoothing), and
evaluation's loss, whose gathered mean is the global batch's token mean."""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_zeropp.accelerate.shares import share_of
from lightning_zeropp.accelerate.steps import NUM_ITEMS, PipelineModel
from lightning_zeropp.fronts.microbatches import loss_shares
from lightning_zeropp.transformers._private import loss_shifts_labels, num_items_in_batch
from lightning_zeropp.transformers.counts import summed_over_data_parallel, without_repeats

__all__ = ["causal_lm", "eval_loss", "last_stage_inputs", "last_stage_loss", "training_loss"]


def training_loss(
    trainer: Any,
    pipeline: PipelineModel,
    model: nn.Module,
    inputs: dict[str, Any],
    return_outputs: bool,
    num_items: Any,
) -> Any:
    """The pipeline's own loss (the model's) in training, as one process computes it.

    The Trainer counts the labelled tokens of the whole accumulation window (summed over
    data-parallel ranks, each row once: `_get_num_items_in_batch`); each micro-batch's summed loss
    is divided by that count, so the step's loss is this batch's share of the window's token mean
    and its gradients add up to the window's. No multiplication by the process count: nothing
    averages gradients over processes. A model not taking the count returns a batch mean, divided
    here by the accumulation steps."""
    window = model.training and num_items is not None
    if window and pipeline.token_weighted and num_items is not None:
        engine = pipeline.engine
        # what the engine averages over: micro-batches, data-parallel and CP ranks (each of
        # which sums its part of the tokens)
        shares = loss_shares(engine.config.num_microbatches, engine.dims, cp_parts=True)
        inputs = {**inputs, NUM_ITEMS: float(num_items) / shares}
    outputs = pipeline(**inputs)
    loss = outputs["loss"]
    if window and not pipeline.token_weighted:
        # The Trainer leaves the division by the accumulation steps to a model taking the
        # count; this one returned a batch mean.
        loss = loss / trainer.current_gradient_accumulation_steps
    return (loss, outputs) if return_outputs else loss


def last_stage_inputs(
    pipeline: PipelineModel, training: bool, inputs: dict[str, Any], num_items: Any
) -> dict[str, Any]:
    """A last-stage loss's inputs (`compute_loss_func`, label smoothing). In training each
    micro-batch's loss is divided by the Trainer's count over its accumulation window (per
    micro-batch and data-parallel rank, as the step averages), as one process's call divides by
    the window's; without that count (evaluation, a model not taking it) by the global batch's
    own: every process gets the global batch's mean, which the Trainer's gathered mean keeps."""
    inputs = {k: v for k, v in inputs.items() if k != NUM_ITEMS}
    if training and num_items is not None:
        engine = pipeline.engine
        # under CP a last-stage loss runs on whole sequences, the same on every CP rank
        # (`accelerate.last_loss`): the CP ranks are not shares of the count
        shares = loss_shares(engine.config.num_microbatches, engine.dims, cp_parts=False)
        inputs[NUM_ITEMS] = float(num_items) / shares
    return inputs


def eval_loss(
    trainer: Any,
    pipeline: PipelineModel,
    inputs: dict[str, Any],
    items: float,
    return_outputs: bool,
) -> Any:
    """The loss the Trainer computes in evaluation under DDP: each process's token sum over
    the global batch's labelled tokens (`items`), times the processes, so that the mean of
    the gathered losses is the global batch's token mean (as one process computes it).

    A batch that splits into the processes' shares gives each its share's sum; one that
    does not (packed rows) gives every process the global batch's token mean, which any
    subset of the processes' values (what gather_for_metrics keeps of a short last batch)
    averages to, without the documents Accelerate repeated (`counts.without_repeats`)."""
    state = trainer.accelerator.gradient_state
    again = without_repeats(inputs, state, pipeline)
    if again is not None:  # every rank counts again: a collective
        inputs = again
        items = float(num_items_in_batch(trainer, [inputs], pipeline.engine.device))
    outputs = pipeline(**{**inputs, NUM_ITEMS: items})
    shares = share_of(pipeline.engine.dims)[0]  # processes reading one rank's rows
    shared = pipeline.rows is not None and pipeline.rows % shares == 0
    if shared:
        loss = outputs["loss"] * dist.get_world_size()
    else:  # this data-parallel rank's token sum over the global count: summed, the mean
        # (the engine's mean ran over CP ranks too, each summing its part of the tokens)
        cp = pipeline.engine.config.cp_size
        loss = summed_over_data_parallel(outputs["loss"], pipeline) * cp
    return (loss, outputs) if return_outputs else loss


def last_stage_loss(trainer: Any) -> tuple[Any, int] | None:
    """The loss the Trainer computes from the model's output, run on the last stage
    (`PipelineModel.use_loss`) with the count of labels the Trainer's own code uses:
    `compute_loss_func`, else label smoothing; None for the model's own loss."""
    if trainer.compute_loss_func is not None:
        shift = 1 if loss_shifts_labels(trainer) else 0
        return trainer.compute_loss_func, shift
    if trainer.label_smoother is not None:
        assert trainer.model is not None  # the Trainer was given one
        causal = causal_lm(trainer.model)  # the Trainer's test: shift the labels by one
        return functools.partial(trainer.label_smoother, shift_labels=causal), int(causal)
    return None


def causal_lm(model: nn.Module) -> bool:
    """Whether the Trainer's label smoothing shifts the labels for `model`: a causal LM class
    (the base model of a PEFT model) by its name, as `Trainer.compute_loss` tests it (a user's
    subclass is not one). FSDP2 shards a model in place by giving it a class of its own
    (`FSDP<name>`; at pp 1 the model is sharded before its loss is chosen): the name read is
    the class it was made from."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = getattr(getattr(model, "base_model", None), "model", None)
    inner = base if callable(getattr(model, "get_base_model", None)) and base is not None else model
    cls = type(inner)
    if issubclass(cls, FSDPModule):  # the class FSDP2 made: the model's own is the next one
        cls = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
    return cls.__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
