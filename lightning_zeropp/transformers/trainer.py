"""`ZeroPPTrainer`: `transformers.Trainer` training a model pipelined over FSDP2.

    trainer = ZeroPPTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                            zeropp_plugin=ZeroPPPlugin(pp_size=2))

is the only changed line of a Trainer script; the Trainer's own loop runs (logging, evaluation,
callbacks, checkpoints, schedulers, gradient accumulation). What differs, and why:
- The Trainer's `Accelerator` is a `ZeroPPAccelerator` (`create_accelerator_and_postprocess`);
  the first data loader needed builds the pipeline (`pipeline`). The model object passed in then
  holds no weights (its parameters move to the meta device): the trained ones live in the
  stages, and stale use fails loudly (`release`).
- One `model(**inputs)` in training mode runs a whole pipeline step, forward and backward
  (`PipelineModel`); its `.loss` is the global batch's loss. `compute_loss` hands the model the
  Trainer's token count over the whole accumulation window, so the loss and gradients are one
  process's (the mean over every labelled token of the global batch), with no DDP scaling
  (`losses`).
- Gradient norms (clipping, the logged `grad_norm`) are over every stage and shard.
- Checkpoints are sharded (`checkpointing.py`, through `trainer_checkpoints.py`) and committed
  atomically; `save_model` writes an ordinary HF directory (adapters only for a PEFT model, as
  the Trainer does).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import TrainingArguments

from lightning_zeropp.accelerate.accelerator import ZeroPPAccelerator
from lightning_zeropp.accelerate.preempt import agree_at_end
from lightning_zeropp.accelerate.settings import ZeroPPPlugin
from lightning_zeropp.accelerate.steps import PipelineModel
from lightning_zeropp.core.step.preempt import Preemption
from lightning_zeropp.transformers import counts, losses
from lightning_zeropp.transformers import pipeline as pipelines
from lightning_zeropp.transformers._private import TrainerOverrides, accelerator_args_builder
from lightning_zeropp.transformers.release import release_weights
from lightning_zeropp.transformers.settings import (
    accelerator_arguments,
    check_trainer_arguments,
    plugin_for,
)
from lightning_zeropp.transformers.trainer_checkpoints import TrainerCheckpoints

__all__ = ["ZeroPPTrainer"]


class ZeroPPTrainer(TrainerCheckpoints):
    """`transformers.Trainer(...)` whose model is pipelined over FSDP2 (ZeroPP).

    Takes every argument of `Trainer`, plus `zeropp_plugin` (the layout; default: the
    `ZEROPP_*` environment variables, then the library's defaults). What the Trainer's arguments
    ask that cannot be pipelined exactly is refused here, on every rank, with the reason.
    """

    # Read by the start-up guard (`_lightning_zeropp_guard`): a Trainer that is ZeroPP's, so
    # ZEROPP_* variables are its settings, not a sign of a script that would ignore them.
    _zeropp_trainer = True

    def __init__(self, *args: Any, zeropp_plugin: ZeroPPPlugin | None = None, **kwargs: Any):
        # the signature of the Trainer class this one pipelines (a TRL trainer's, for its
        # ZeroPP class: `lightning_zeropp.trl`)
        mro = type(self).__mro__
        pipelined = mro[mro.index(TrainerOverrides) + 1]
        init = inspect.signature(pipelined).bind(*args, **kwargs).arguments
        training_args = init.get("args")
        if training_args is None:  # what the Trainer would build itself
            training_args = self._default_args()
            kwargs["args"] = training_args
        check_trainer_arguments(training_args, init)
        self._zeropp_plugin = plugin_for(zeropp_plugin, training_args)
        self._pipeline: PipelineModel | None = None
        # metrics a last-stage loss returned since the last training log
        self._last_stage_metrics: dict[str, list[float]] = {}
        super().__init__(*args, **kwargs)

    def _default_args(self) -> Any:
        """The arguments the Trainer builds when given none."""
        return TrainingArguments(output_dir="tmp_trainer")

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`; then every rank agrees whether SIGTERM came after the last step's
        agreement (it stops there, 143, and saves with `save_on_sigterm`). SIGTERM is the
        library's during the call only: the handler before it is restored at its end."""
        Preemption.of_process().install()  # again, for a second train() on this Trainer
        try:
            result = super().train(*args, **kwargs)
            agree_at_end(self._pipeline)
        finally:
            Preemption.of_process().uninstall()
        return result

    # ------------------------------------------------------------------ the accelerator
    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's own accelerator settings, on a `ZeroPPAccelerator`: no FSDP or
        DeepSpeed plugin (refused), and mixed precision as FSDP2's (`bf16=True` is mapped onto
        the plugin's `param_dtype`), since the stages are not prepared models to autocast."""
        kwargs = accelerator_arguments(self.args, accelerator_args_builder(self))
        self.accelerator = ZeroPPAccelerator(zeropp_plugin=self._zeropp_plugin, **kwargs)
        self.gather_function = functools.partial(
            self.accelerator.gather_for_metrics, use_gather_object=self.args.eval_use_gather_object
        )
        self.is_deepspeed_enabled = False
        self.is_fsdp_enabled = False

    def _zeropp_move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """The stages go to the device when the pipeline is built; the whole model never does."""

    # ------------------------------------------------------------------ the pipeline
    @property
    def pipeline(self) -> PipelineModel | None:
        """This rank's stages as a model (`PipelineModel`), once built; else None."""
        return self._pipeline

    def get_train_dataloader(self) -> DataLoader:
        with pipelines.unprepared_loaders(self.accelerator):
            raw = super().get_train_dataloader()
        return self._prepared(raw, training=True)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        with pipelines.unprepared_loaders(self.accelerator):
            raw = super().get_eval_dataloader(eval_dataset)
        return self._prepared(raw)

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        with pipelines.unprepared_loaders(self.accelerator):
            raw = super().get_test_dataloader(test_dataset)
        return self._prepared(raw)

    def _prepared(self, raw: DataLoader, training: bool = False) -> DataLoader:
        if self._pipeline is None:
            if training or self.train_dataset is None:
                return self._build_pipeline(raw)
            with pipelines.unprepared_loaders(self.accelerator):
                example = super().get_train_dataloader()  # the split's example batch
            self._build_pipeline(example)
        return self.accelerator.prepare(raw)

    def _build_pipeline(self, loader: DataLoader) -> DataLoader:
        """Split, shard and schedule the model; rebuild the optimizer (and a scheduler passed
        in) over this rank's stages; return `loader` sharded over data-parallel ranks."""
        pipeline, prepared = pipelines.build(self, loader)
        assert self.model is not None  # the Trainer was given one
        loss = self._last_stage_loss()
        if loss is not None:
            pipeline.use_loss(loss[0], shift=loss[1])
        release_weights(self.model, kept=pipeline.engine.module)
        self._pipeline = self.model_wrapped = pipeline
        if pipeline.stopper is not None:  # on SIGTERM: the Trainer's own checkpoint and step
            pipeline.stopper.saver = functools.partial(pipelines.save_on_sigterm, self)
            pipeline.stopper.step = lambda: self.state.global_step
        return prepared

    def _last_stage_loss(self) -> tuple[Any, int] | None:
        """The Trainer's loss from the model's output, run on the last stage (`losses`)."""
        return losses.last_stage_loss(self)

    def _zeropp_wrap_model(
        self, model: nn.Module, training: bool = True, dataloader: Any = None
    ) -> Any:
        if self._pipeline is None:  # evaluation_loop asks after building its loader
            raise RuntimeError("ZeroPPTrainer: the pipeline is built with the first data loader")
        return self._pipeline

    def _zeropp_prepare_for_training(
        self, max_steps: int, train_dataloader: DataLoader, resume_from_checkpoint: str | None
    ) -> tuple[PipelineModel, DataLoader]:
        """The scheduler on the rebuilt optimizer, and a checkpoint resumed (`pipeline`)."""
        assert self._pipeline is not None
        pipelines.prepare_for_training(
            self, self._pipeline, max_steps, train_dataloader, resume_from_checkpoint
        )
        return self._pipeline, train_dataloader

    # ------------------------------------------------------------------ steps
    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """The pipeline's loss of the global batch, as one process computes it (`losses`)."""
        pipeline = model if isinstance(model, PipelineModel) else self._pipeline
        assert pipeline is not None
        if pipeline.last_loss is not None:
            return self._last_stage_step(
                pipeline, model, inputs, return_outputs, num_items_in_batch
            )
        if not model.training and num_items_in_batch is not None and pipeline.token_weighted:
            items = float(num_items_in_batch)
            return losses.eval_loss(self, pipeline, inputs, items, return_outputs)
        return losses.training_loss(
            self, pipeline, model, inputs, return_outputs, num_items_in_batch
        )

    def _last_stage_step(
        self,
        pipeline: PipelineModel,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool,
        num_items_in_batch: Any,
    ) -> Any:
        """`compute_loss_func` or label smoothing on the last stage (`losses.last_stage_inputs`).
        The metrics a loss returns are logged like the loss (mean over the logging interval)."""
        inputs = losses.last_stage_inputs(pipeline, model.training, inputs, num_items_in_batch)
        outputs = pipeline(**inputs)
        self._record_metrics(outputs.metrics, inputs, model.training)
        loss = outputs["loss"]
        return (loss, outputs) if return_outputs else loss

    def _record_metrics(
        self, metrics: dict[str, float], inputs: dict[str, Any], training: bool
    ) -> None:
        """A training step's last-stage metrics, logged with the loss (`log`)."""
        if training:
            for name, value in metrics.items():
                self._last_stage_metrics.setdefault(name, []).append(value)

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[Any, Any, Any]:
        pipeline = self._pipeline
        assert pipeline is not None
        keep = pipeline.eval_logits
        pipeline.eval_logits = keep and not prediction_loss_only  # no broadcast nobody reads
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        finally:
            pipeline.eval_logits = keep

    # ------------------------------------------------------------------ counts over processes
    def _zeropp_get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        """The window's token count, each row once, of the first stage's batches (`counts`)."""
        return counts.items_in_window(self, self._pipeline, batch_samples, device)

    def _zeropp_track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        """Tokens seen, as one process counts them (`counts`)."""
        counts.track_input_tokens(self, self._pipeline, inputs)

    def store_flos(self) -> None:
        with counts.summing_over_data_parallel(self.accelerator, self._pipeline):
            super().store_flos()

    def _zeropp_clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """Clip by the norm over every stage and shard (tied copies counted once)."""
        assert self._pipeline is not None
        return self._pipeline.engine.core.clip_grad_norm_(self.args.max_grad_norm)

    def _zeropp_get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            assert self._pipeline is not None
            grad_norm = self._pipeline.engine.core.clip_grad_norm_(float("inf"))
        return grad_norm

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log; its closing metrics also say what re-planning for new batch
        shapes cost (`core.measure.planning`): schedules built, evicted, seconds."""
        if "loss" in logs and self._last_stage_metrics:  # a training log: the interval's means
            for name, values in self._last_stage_metrics.items():
                logs.setdefault(name, sum(values) / len(values))
            self._last_stage_metrics = {}
        if "train_runtime" in logs and self._pipeline is not None:
            stats = self._pipeline.engine.core.planning.summary()
            logs.update({f"train_{key}": value for key, value in stats.items()})
        super().log(logs, start_time)
