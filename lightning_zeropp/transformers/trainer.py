"""`ZeroPPTrainer`: `transformers.Trainer` training a model pipelined over FSDP2.

    trainer = ZeroPPTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                            zeropp_plugin=ZeroPPPlugin(pp_size=2))

is the only changed line of a Trainer script; the Trainer's own loop runs (logging, evaluation,
callbacks, checkpoints, schedulers, gradient accumulation). What differs, and why:
- The Trainer's `Accelerator` is a `ZeroPPAccelerator` (`create_accelerator_and_postprocess`).
  Its `prepare` must see the model, its optimizer and the training loader together, and the
  Trainer prepares the loader first: so loaders are built unprepared, and the first one needed
  builds the pipeline (optimizer created on the whole model, as under DDP, then rebuilt over this
  rank's stages). The model object passed in then holds no weights (its parameters move to the
  meta device): the trained ones live in the stages, and stale use fails loudly.
- One `model(**inputs)` in training mode runs a whole pipeline step, forward and backward
  (`PipelineModel`); its `.loss` is the global batch's loss. `compute_loss` hands the model the
  Trainer's token count over the whole accumulation window, so the loss and gradients are one
  process's (the mean over every labelled token of the global batch), with no DDP scaling.
- Gradient norms (clipping, the logged `grad_norm`) are over every stage and shard.
- Checkpoints are sharded (`checkpointing.py`) and committed atomically; `save_model` writes an
  ordinary HF directory (adapters only for a PEFT model, as the Trainer does).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from transformers import TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from lightning_zeropp.accelerate.accelerator import ZeroPPAccelerator
from lightning_zeropp.accelerate.preempt import agree_at_end
from lightning_zeropp.accelerate.settings import ZeroPPPlugin
from lightning_zeropp.accelerate.shares import share_of
from lightning_zeropp.accelerate.steps import NUM_ITEMS, PipelineModel
from lightning_zeropp.core.step.preempt import Preemption
from lightning_zeropp.fronts.optim import retarget_scheduler
from lightning_zeropp.transformers import checkpointing
from lightning_zeropp.transformers._private import (
    TrainerOverrides,
    accelerator_args_builder,
    forget_created_scheduler,
    load_optimizer_and_scheduler,
    loss_shifts_labels,
    num_items_in_batch,
    run_folder,
    save_checkpoint,
    scheduler_created,
    trainer_init_training_state,
    trainer_num_items_in_batch,
    trainer_track_num_input_tokens,
)
from lightning_zeropp.transformers.counts import (
    padded_tokens,
    summed_over_data_parallel,
    summing_over_data_parallel,
    without_repeats,
)
from lightning_zeropp.transformers.settings import (
    accelerator_arguments,
    check_trainer_arguments,
    plugin_for,
)

__all__ = ["ZeroPPTrainer"]


class ZeroPPTrainer(TrainerOverrides):
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
        with self._unprepared_loaders():
            raw = super().get_train_dataloader()
        return self._prepared(raw, training=True)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        with self._unprepared_loaders():
            raw = super().get_eval_dataloader(eval_dataset)
        return self._prepared(raw)

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        with self._unprepared_loaders():
            raw = super().get_test_dataloader(test_dataset)
        return self._prepared(raw)

    @contextlib.contextmanager
    def _unprepared_loaders(self) -> Iterator[None]:
        """The Trainer's loader, built by its own code but not prepared: the pipeline shards
        loaders over its data-parallel ranks, and needs the training loader to be built."""
        self.accelerator.prepare = lambda loader: loader  # shadows the method on this instance
        try:
            yield
        finally:
            del self.accelerator.prepare

    def _prepared(self, raw: DataLoader, training: bool = False) -> DataLoader:
        if self._pipeline is None:
            if training or self.train_dataset is None:
                return self._build_pipeline(raw)
            with self._unprepared_loaders():
                example = super().get_train_dataloader()  # the split's example batch
            self._build_pipeline(example)
        return self.accelerator.prepare(raw)

    def _build_pipeline(self, loader: DataLoader) -> DataLoader:
        """Split, shard and schedule the model; rebuild the optimizer (and a scheduler passed
        in) over this rank's stages; return `loader` sharded over data-parallel ranks."""
        if self.optimizer is None:
            self.create_optimizer()  # on the whole model, as under DDP
        given = self.lr_scheduler if not scheduler_created(self) else None
        whole = self.optimizer
        pipeline, optimizer, prepared = self.accelerator.prepare(self.model, whole, loader)
        self.optimizer = optimizer
        if given is not None:  # the Trainer steps it once per update, as it is
            self.lr_scheduler = retarget_scheduler(given, whole, optimizer.optimizer)
        assert self.model is not None  # the Trainer was given one
        loss = self._last_stage_loss()
        if loss is not None:
            pipeline.use_loss(loss[0], shift=loss[1])
        release_weights(self.model, kept=pipeline.engine.module)
        self._pipeline = self.model_wrapped = pipeline
        if pipeline.stopper is not None:  # on SIGTERM: the Trainer's own checkpoint and step
            pipeline.stopper.saver = self._save_on_sigterm
            pipeline.stopper.step = lambda: self.state.global_step
        return prepared

    def _last_stage_loss(self) -> tuple[Any, int] | None:
        """The loss the Trainer computes from the model's output, run on the last stage
        (`PipelineModel.use_loss`) with the count of labels the Trainer's own code uses:
        `compute_loss_func`, else label smoothing; None for the model's own loss."""
        if self.compute_loss_func is not None:
            shift = 1 if loss_shifts_labels(self) else 0
            return self.compute_loss_func, shift
        if self.label_smoother is not None:
            assert self.model is not None  # the Trainer was given one
            causal = causal_lm(self.model)  # the Trainer's test: shift the labels by one
            return functools.partial(self.label_smoother, shift_labels=causal), int(causal)
        return None

    def _save_on_sigterm(self, steps: int) -> str:
        """Collective: `checkpoint-<global_step>`, which `resume_from_checkpoint=True` finds."""
        save_checkpoint(self, self.model_wrapped)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        path = os.path.join(run_folder(self, trial=None), name)
        return f"saved checkpoint at {path} (resume with train(resume_from_checkpoint=True))"

    def _zeropp_wrap_model(
        self, model: nn.Module, training: bool = True, dataloader: Any = None
    ) -> Any:
        if self._pipeline is None:  # evaluation_loop asks after building its loader
            raise RuntimeError("ZeroPPTrainer: the pipeline is built with the first data loader")
        return self._pipeline

    def _zeropp_prepare_for_training(
        self, max_steps: int, train_dataloader: DataLoader, resume_from_checkpoint: str | None
    ) -> tuple[PipelineModel, DataLoader]:
        """The pipeline and the rebuilt optimizer exist (the training loader built them): the
        scheduler is created on that optimizer, and a checkpoint resumed into both."""
        assert self._pipeline is not None
        if scheduler_created(self):
            forget_created_scheduler(self)
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = self._pipeline
        load_optimizer_and_scheduler(self, resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self._pipeline, train_dataloader

    # ------------------------------------------------------------------ steps
    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """The pipeline's loss of the global batch, as one process computes it.

        In training, the Trainer counts the labelled tokens of the whole accumulation window
        (summed over data-parallel ranks, each row once: `_get_num_items_in_batch`); each
        micro-batch's summed loss is divided by that count, so the step's loss is this batch's
        share of the window's token mean and its gradients add up to the window's. No
        multiplication by the process count: nothing averages gradients over processes.
        """
        pipeline = model if isinstance(model, PipelineModel) else self._pipeline
        assert pipeline is not None
        if pipeline.last_loss is not None:
            return self._last_stage_step(
                pipeline, model, inputs, return_outputs, num_items_in_batch
            )
        if not model.training and num_items_in_batch is not None and pipeline.token_weighted:
            return self._eval_loss(pipeline, inputs, float(num_items_in_batch), return_outputs)
        window = model.training and num_items_in_batch is not None
        if window and pipeline.token_weighted and num_items_in_batch is not None:
            engine = pipeline.engine
            # what the engine averages over: micro-batches, data-parallel and CP ranks (each of
            # which sums its part of the tokens)
            micro = engine.config.num_microbatches * engine.dims.grad_size
            inputs = {**inputs, NUM_ITEMS: float(num_items_in_batch) / micro}
        outputs = pipeline(**inputs)
        loss = outputs["loss"]
        if window and not pipeline.token_weighted:
            # The Trainer leaves the division by the accumulation steps to a model taking the
            # count; this one returned a batch mean.
            loss = loss / self.current_gradient_accumulation_steps
        return (loss, outputs) if return_outputs else loss

    def _last_stage_step(
        self,
        pipeline: PipelineModel,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool,
        num_items_in_batch: Any,
    ) -> Any:
        """`compute_loss_func` or label smoothing on the last stage. In training each micro-batch's
        loss is divided by the Trainer's count over its accumulation window (per micro-batch and
        data-parallel rank, as the step averages), as one process's call divides by the window's;
        without that count (evaluation, a model not taking it) by the global batch's own: every
        process gets the global batch's mean, which the Trainer's gathered mean keeps. The
        metrics a loss returns are logged like the loss (mean over the logging interval)."""
        inputs = {k: v for k, v in inputs.items() if k != NUM_ITEMS}
        if model.training and num_items_in_batch is not None:
            engine = pipeline.engine
            micro = engine.config.num_microbatches * engine.dims.dp_size
            inputs[NUM_ITEMS] = float(num_items_in_batch) / micro
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

    def _eval_loss(
        self, pipeline: PipelineModel, inputs: dict[str, Any], items: float, return_outputs: bool
    ) -> Any:
        """The loss the Trainer computes in evaluation under DDP: each process's token sum over
        the global batch's labelled tokens (`items`), times the processes, so that the mean of
        the gathered losses is the global batch's token mean (as one process computes it).

        A batch that splits into the processes' shares gives each its share's sum; one that
        does not (packed rows) gives every process the global batch's token mean, which any
        subset of the processes' values (what gather_for_metrics keeps of a short last batch)
        averages to, without the documents Accelerate repeated (`counts.without_repeats`)."""
        state = self.accelerator.gradient_state
        again = without_repeats(inputs, state, pipeline)
        if again is not None:  # every rank counts again: a collective
            inputs = again
            items = float(num_items_in_batch(self, [inputs], pipeline.engine.device))
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
        """The Trainer's token count of the accumulation window, each row counted once, of the
        batches the pipeline trains on: its first stage's (a random collator draws on each
        rank), shared before the count and written into each rank's batch."""
        if self._pipeline is not None:
            shared = self._pipeline.engine.core.batches.share
            batch_samples[:] = [shared(batch) for batch in batch_samples]
        with self._summing_over_data_parallel():
            return trainer_num_items_in_batch(self, batch_samples, device)

    def _zeropp_track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        """Tokens seen, as one process counts them (`counts.padded_tokens`)."""
        name = getattr(self.model, "main_input_name", "input_ids")
        padded = self.args.include_num_input_tokens_seen == "all"
        seen = padded_tokens(inputs, name, self._pipeline) if padded else None
        if seen is None:
            with self._summing_over_data_parallel():
                trainer_track_num_input_tokens(self, inputs)
        else:
            self.state.num_input_tokens_seen += seen

    def store_flos(self) -> None:
        with self._summing_over_data_parallel():
            super().store_flos()

    def _summing_over_data_parallel(self) -> contextlib.AbstractContextManager[None]:
        return summing_over_data_parallel(self.accelerator, self._pipeline)

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

    # ------------------------------------------------------------------ checkpoints
    def _zeropp_save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        checkpointing.save(self, trial)

    def _zeropp_load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Checked here, on every rank; loaded once the pipeline exists (`_prepare_for_training`)."""
        checkpointing.check_resumable(resume_from_checkpoint)

    def _zeropp_init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: str | None,
        trial: Any,
    ) -> tuple[int, int]:
        """The Trainer's; a resume with another global batch than the checkpoint's is refused
        here, before anything is skipped (`checkpointing.check_resumed_rows`)."""
        done = trainer_init_training_state(
            self,
            max_steps,
            num_update_steps_per_epoch,
            num_train_epochs,
            resume_from_checkpoint,
            trial,
        )
        if resume_from_checkpoint is not None:
            checkpointing.check_resumed_rows(self, resume_from_checkpoint)
        return done

    def _zeropp_load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        """Collective: the sharded model and optimizer, and the scheduler, of a checkpoint."""
        if checkpoint_dir is not None:
            checkpointing.load(self, checkpoint_dir)

    def _zeropp_load_rng_state(self, checkpoint: str | None) -> None:
        """The Trainer's, reading the RNG file as data (named, with the fix, if it is not)."""
        if checkpoint is not None:
            checkpointing.load_rng_state(self, checkpoint)

    def _zeropp_load_best_model(self) -> None:
        checkpointing.load_best_model(self)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective: an ordinary HF directory (`from_pretrained` reads it) from the main
        process; a PEFT model's adapters only, as the Trainer writes them."""
        output_dir = output_dir or self.args.output_dir
        assert output_dir is not None  # TrainingArguments fills in a default
        checkpointing.save_model(self, output_dir)


def causal_lm(model: nn.Module) -> bool:
    """Whether the Trainer's label smoothing shifts the labels for `model`: a causal LM class
    (the base model of a PEFT model), as `Trainer.compute_loss` tests it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = getattr(getattr(model, "base_model", None), "model", None)
    inner = base if callable(getattr(model, "get_base_model", None)) and base is not None else model
    return inner._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


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
        if id(module) in in_pipeline:
            continue
        if module is model or callable(getattr(module, "save_pretrained", None)):
            module.register_state_dict_pre_hook(_refuse_released)


_RELEASED = (
    "this model's weights moved into the pipeline's stages when ZeroPPTrainer built it (its "
    "parameters are on the meta device now), so it has no weights to save or read. Use "
    "trainer.save_model(dir) (an HF directory; the adapter only for a PEFT model), or "
    "whole = trainer.accelerator.unwrap_model(trainer.model_wrapped) on every rank, then "
    "whole.save_pretrained(dir) / whole.merge_and_unload() on the main process."
)


def _refuse_released(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """A state dict of the released model (`model.save_pretrained(dir)`, the usual closing line
    of a PEFT script) says what to use instead of failing on a meta tensor; once
    `unwrap_model` has put the trained weights back (the main process), it is the model's."""
    if any(p.device.type == "meta" for p in module.parameters()):
        raise RuntimeError(_RELEASED)
