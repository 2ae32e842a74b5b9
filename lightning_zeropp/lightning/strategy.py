"""`ZeroPPStrategy`: Lightning's words translated to the core, in one place.

How an unmodified LightningModule trains under a pipeline:
- at setup, the module's network (its single child holding all parameters, e.g. `self.model`, or
  the child named by `module_name`) is split, sharded and replaced by this rank's stages;
- `training_step` (the strategy's) runs the whole pipeline schedule for the batch. On the last
  stage the user's own `training_step` is the loss function: it receives each micro-batch, and
  `self(x)` / `self.model(x)` inside it return the pipeline's output for that micro-batch. On the
  first stage the model inputs are found by running `training_step` until it calls the model;
- the gradients the schedule produced are set aside until Lightning's `backward`, because Lightning
  zeroes gradients between `training_step` and `backward`;
- what the user logs per micro-batch is averaged, sent from the last stage to every stage, and
  logged on every rank, so rank 0's loggers and `sync_dist=True` see the real values.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_zeropp.core.engine import ZeroPPEngine
from lightning_zeropp.core.measure.layout import describe_layout
from lightning_zeropp.core.mesh import ParallelDims, build_mesh
from lightning_zeropp.core.settings import env, launch
from lightning_zeropp.core.split.call_adapter import CallAdapter, get_call_adapter
from lightning_zeropp.core.split.call_plan import meta_copy
from lightning_zeropp.core.split.methods import SplitMethod, check_split
from lightning_zeropp.core.step.agree import agree, settings_fields
from lightning_zeropp.core.step.failure import failure_guard, guarded
from lightning_zeropp.core.step.grads import StepGrads
from lightning_zeropp.core.weights import checkpoint as ckpt
from lightning_zeropp.core.weights import commit, export, trust
from lightning_zeropp.core.weights.async_checkpoint import AsyncCheckpointer
from lightning_zeropp.core.weights.materialize import InitFn, empty_parameters
from lightning_zeropp.lightning import checkpointing, network, resume, settings
from lightning_zeropp.lightning.steps import StepRunner
from lightning_zeropp.models.hf_loss import (
    TokenCountAdapter,
    accepts_num_items,
    disable_kv_cache,
    is_causal_lm,
)

__all__ = ["ZeroPPStrategy"]


class ZeroPPPrecision(Precision):
    """fp32 Lightning precision whose backward releases the pipeline's gradients and whose norm
    clipping uses the global norm over all stages and shards (mixed precision is FSDP2's job:
    `ZeroPPStrategy(param_dtype="bf16")`)."""

    def __init__(self, strategy: ZeroPPStrategy) -> None:
        super().__init__()
        self._strategy = strategy

    @override
    def backward(self, tensor: torch.Tensor, model: pl.LightningModule, *args: Any, **kwargs: Any):
        self._strategy._release_gradients()

    @override
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        self._strategy.engine.clip_grad_norm_(clip_val)


class ZeroPPStrategy(ModelParallelStrategy):
    """Pipeline parallelism over FSDP2 for an unmodified LightningModule.

    Args mirror `ZeroPPConfig` (pp_size, dp_shard_size, dp_replicate_size, num_microbatches,
    schedule, num_chunks, param_dtype, reduce_dtype, activation_checkpointing,
    reshard_after_forward, split_points, unit_size, split_backward, grad_reduce, nonfinite, and
    ZeRO++'s quantized_weights, hpz_partition_size, quantized_gradients, gradient_error_feedback,
    quant_block_size, cpu_offload, node_size: `core.settings.plus`). One
    left out (None) takes its `ZEROPP_*` variable when set, else `ZeroPPConfig`'s default; one
    given wins over its variable, as with Accelerate's `ZeroPPPlugin`. Plus:
        split: "auto" (default: "call" unless the model names another), "call" (the network's
            own forward cut at its block calls; input shapes are read from the first batch, or
            from `example_input_array` if set), "trace" (torch.export; one micro-batch of fixed
            shape), "stack", or a callable (see `lightning_zeropp.core.split`).
        module_name: the LightningModule attribute to pipeline (default: its only child module
            that holds parameters).
        timeout: for every process group.
        log_comms: log every training step's collectives as metrics
            `comm/{kind}/{axis}/count|bytes` (per rank, averaged over ranks; see
            `ZeroPPEngine.comm_metrics`).
        state_dict_type: what `trainer.save_checkpoint` / `ModelCheckpoint` write: "sharded"
            (default; a distributed checkpoint directory, every rank writes its shards) or
            "full" (one ordinary Lightning checkpoint file, gathered to and written by global
            rank 0, that `MyModule.load_from_checkpoint` reads in one process). `ckpt_path=`
            takes either (see `lightning_zeropp.lightning.checkpointing`).
        async_save: save sharded checkpoints in the background: the step waits only for a copy
            of the state in host memory, and the checkpoint is published under its name when
            every rank has written it (`core.weights.async_checkpoint`); a save waits for the last one.
        load_from: weights to start from, read by each rank for its own shards only: a
            distributed checkpoint (any layout) or safetensors (a file, or an HF model
            directory). With a network built in `configure_model` (or under
            `trainer.init_module(empty_init=True)`), whose parameters are then on the meta
            device, the whole model never exists in one process.
        init: `init(module)` per module for a network built on the meta device without
            `load_from` (default: the network's own `_init_weights`, else each module's
            `reset_parameters()`; see `lightning_zeropp.core.weights.materialize`).

    `accumulate_grad_batches=k` means what it means in Lightning: the update uses the mean
    gradient over k consecutive (global) batches. The pipeline's micro-batches are a separate,
    inner accumulation inside each batch.
    """

    strategy_name = "zeropp"

    def __init__(
        self,
        *,
        pp_size: int | None = None,
        dp_shard_size: int | None = None,
        dp_replicate_size: int | None = None,
        num_microbatches: int | None = None,
        schedule: str | None = None,
        num_chunks: int | None = None,
        param_dtype: str | torch.dtype | None = None,
        reduce_dtype: str | torch.dtype | None = None,
        activation_checkpointing: bool | str | None = None,
        reshard_after_forward: bool | None = None,
        split_points: list[int] | None = None,
        unit_size: int | None = None,
        split_backward: bool | None = None,
        grad_reduce: str | None = None,
        nonfinite: str | None = None,
        quantized_weights: str | None = None,
        hpz_partition_size: int | None = None,
        quantized_gradients: str | None = None,
        gradient_error_feedback: bool | None = None,
        quant_block_size: int | None = None,
        cpu_offload: bool | None = None,
        node_size: int | None = None,
        split: SplitMethod = "auto",
        module_name: str | None = None,
        timeout: datetime.timedelta = datetime.timedelta(minutes=30),
        process_group_backend: str | None = None,
        log_comms: bool = False,
        state_dict_type: str = "sharded",
        async_save: bool = False,
        load_from: str | Path | None = None,
        init: InitFn | None = None,
    ) -> None:
        launch.check_timeout(timeout)
        self._state_dict_type = checkpointing.check_state_dict_type(state_dict_type)
        if async_save and state_dict_type != "sharded":
            raise ValueError(
                f"async_save=True writes sharded checkpoints (state_dict_type='sharded'), not "
                f"state_dict_type={state_dict_type!r}; drop one of the two."
            )
        self._async = AsyncCheckpointer() if async_save else None
        super().__init__(
            save_distributed_checkpoint=state_dict_type == "sharded",
            timeout=timeout,
            process_group_backend=process_group_backend,
        )
        self.zeropp_config, self._from_env = settings.config_from_arguments(
            pp_size=pp_size,
            dp_shard_size=dp_shard_size,
            dp_replicate_size=dp_replicate_size,
            num_microbatches=num_microbatches,
            schedule=schedule,
            num_chunks=num_chunks,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            activation_checkpointing=activation_checkpointing,
            reshard_after_forward=reshard_after_forward,
            split_points=split_points,
            unit_size=unit_size,
            split_backward=split_backward,
            grad_reduce=grad_reduce,
            nonfinite=nonfinite,
            quantized_weights=quantized_weights,
            hpz_partition_size=hpz_partition_size,
            quantized_gradients=quantized_gradients,
            gradient_error_feedback=gradient_error_feedback,
            quant_block_size=quant_block_size,
            cpu_offload=cpu_offload,
            node_size=node_size,
        )
        self._log_comms = log_comms
        self._load_from, self._init = load_from, init
        self._split = (env.split_from_env() or "auto") if split == "auto" else split
        check_split(self._split)
        self._module_name = module_name
        self._pipelined: str | None = None  # the LightningModule attribute that was pipelined
        self._dims: ParallelDims | None = None
        self._engine: ZeroPPEngine | None = None
        self._pending: StepGrads | None = None  # the last training step's, until backward
        self._runner = StepRunner()

    # ---------------------------------------------------------------- properties
    @property
    def engine(self) -> ZeroPPEngine:
        if self._engine is None:
            raise RuntimeError("the ZeroPP engine exists only after the strategy's setup()")
        return self._engine

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Data is split over data-parallel ranks only: all stages of one pipeline see one batch.
        assert self._dims is not None
        return {"num_replicas": self._dims.dp_size, "rank": self._dims.dp_rank}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # A fit resumed mid-epoch continues with the next unseen batch (`lightning.resume`).
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        return resume.resuming_loader(dataloader, trainer)

    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        if (
            plugin is not None
            and type(plugin) is not Precision
            and not isinstance(plugin, ZeroPPPrecision)
        ):
            raise ValueError(
                f"ZeroPPStrategy runs Lightning in precision='32-true'; got {type(plugin).__name__}. "
                "For bf16, keep the Trainer's precision at '32-true' and pass "
                "ZeroPPStrategy(param_dtype='bf16') (FSDP2 mixed precision)."
            )
        self._precision_plugin = plugin if plugin is None else ZeroPPPrecision(self)

    # ---------------------------------------------------------------- set-up
    @override
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # `trainer.init_module(empty_init=True)`: parameters on the meta device, buffers real;
        # each rank allocates its own shards at setup.
        with empty_parameters() if empty_init else contextlib.nullcontext():
            yield

    @override
    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        # What `configure_model` builds is sharded at setup: it is never whole in memory.
        with empty_parameters():
            yield

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        env_ = self.cluster_environment
        if self._launcher is not None and "MASTER_PORT" in os.environ and env_.node_rank() == 0:
            # This process starts the ranks and hosts their store: a busy port would leave
            # the ranks it starts waiting on whatever holds it.
            launch.check_port_free(env_.main_address, env_.main_port)

    @override
    def setup_environment(self) -> None:
        # Validate on every rank before the process group exists: a bad size fails everywhere.
        world_size = self.num_nodes * self.num_processes
        self.zeropp_config = settings.resolve_config(self.zeropp_config, world_size, self._from_env)
        launch.check_restart()
        timeout = self._timeout.total_seconds() if self._timeout else 1800.0
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        with launch.join_deadline(timeout + 30, f"joining the process group (store at {where})"):
            self._setup_distributed()
        # Ranks that resolved other settings (a ZEROPP_* variable set on one node) stop here.
        with failure_guard():
            agree(settings_fields(self.zeropp_config))
            if self._dims is None:  # fit then validate on one Trainer sets up twice: one mesh
                self._dims = build_mesh(self.zeropp_config, self.root_device.type)
        self._device_mesh = self._dims.mesh
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._dims.mesh

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise ValueError(
                "ZeroPPStrategy needs automatic optimization: the pipeline schedule runs forward "
                "and backward together. Remove `self.automatic_optimization = False`."
            )
        name = network.pipelined_name(module, self._module_name)
        if self._engine is None or module._modules[name] is not self._engine.module:
            self._build_engine(module, name, trainer)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self.engine.report_memory_after_first_update(self.optimizers, rank_zero_info)
        self.setup_precision_plugin()

    def _build_engine(self, module: pl.LightningModule, name: str, trainer: pl.Trainer) -> None:
        """Split, shard and schedule the module's network; put this rank's stages in its place."""
        # How the user's calls of the network map to stage inputs and outputs (e.g. HF's `labels=`
        # and `.logits`); read now, since the stages that replace the network do not carry it.
        runner = self._runner
        runner.module, runner.attr = module, name
        net = getattr(module, name)
        runner.adapter = get_call_adapter(net)
        if type(runner.adapter) is CallAdapter and accepts_num_items(net):
            # A plain HF model: padded batches' losses are token means, as in one process.
            runner.adapter = TokenCountAdapter(shift=is_causal_lm(net))
        self._pipelined = name
        disable_kv_cache(net)  # plain HF models: a stage returns tensors only
        example_args, example_kwargs = self._example(module, trainer)
        whole = meta_copy(net)  # before sharding: a single stage is sharded in place
        self._engine = ZeroPPEngine(
            net,
            self.zeropp_config,
            loss_fn=runner.scheduled_loss,
            probe_loss_fn=runner.probe_loss,
            split=self._split,
            example_args=example_args,
            example_kwargs=example_kwargs,
            device=self.root_device,
            dims=self._dims,
            count_comms=self._log_comms,
            init=self._init,
            load_from=self._load_from,
        )
        module._modules[name] = self._engine.module
        runner.engine = self._engine
        rank_zero_info(describe_layout(self._engine))  # collective: every rank builds the text
        rank_zero_info(self._engine.memory_report(title="at setup"))  # collective too
        network.summarize_whole_model(trainer, name, whole)
        # The example served the split. Lightning's model summary would feed it to this rank's
        # stages as if they were the whole model, so it goes.
        module.example_input_array = None

    def _example(
        self, module: pl.LightningModule, trainer: pl.Trainer
    ) -> tuple[tuple[Any, ...] | None, dict[str, Any] | None]:
        """One micro-batch of the network's inputs, for the splits that need one."""
        cfg = self.zeropp_config
        if callable(self._split) or self._split == "stack" or cfg.num_stages == 1:
            return None, None
        assert cfg.num_microbatches is not None
        return network.example_microbatch(
            module, trainer, self._runner, cfg.num_microbatches, self.batch_to_device
        )

    # ---------------------------------------------------------------- steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.lightning_module is not None
        # Lightning zeroes the previous step's gradients (unless accumulating) only after
        # training_step, and expects this step's gradients to appear in backward: the engine
        # holds them (`StepGrads`) until then.
        outcome = self._runner.run(self.lightning_module.training_step, args, "train")
        assert outcome.grads is not None
        if outcome.skipped:  # the step returned None: no gradient from this batch, anywhere
            outcome.grads.discard()
        else:
            self._pending = outcome.grads
        if self._log_comms:
            self.lightning_module.log_dict(self.engine.comm_metrics(), on_step=True, on_epoch=False)
        return outcome.loss.detach().requires_grad_(True)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None
        return self._runner.run(self.lightning_module.validation_step, args, "eval").loss

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None
        return self._runner.run(self.lightning_module.test_step, args, "eval").loss

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's predict_step per micro-batch on the last stage; the batch's predictions
        (tensors concatenated along rows) on every rank of the pipeline."""
        assert self.lightning_module is not None
        return self._runner.run(self.lightning_module.predict_step, args, "predict").predictions

    def _release_gradients(self) -> None:
        assert self.lightning_module is not None
        if self._pending is not None:  # Lightning's mean over accumulate_grad_batches batches
            self._pending.apply(1.0 / self.lightning_module.trainer.accumulate_grad_batches)
            self._pending = None

    # ---------------------------------------------------------------- checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._state_dict_type == "sharded":
            return {}  # model state is written by save_checkpoint through DCP, sharded
        # Collective: the LightningModule's whole state_dict (its own names) on global rank 0.
        return export.full_state_dict(self.lightning_module, self.engine.dims)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self._state_dict_type == "sharded":
            return {}  # likewise
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        return export.full_optimizer_state_dict(self.lightning_module, optimizer, self.engine.dims)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("ZeroPPStrategy.save_checkpoint does not take storage_options")
        path = Path(self.broadcast(str(filepath)))
        if self._state_dict_type == "full":
            export.save_file(path, checkpoint)  # complete on rank 0; tmp file + rename
            return
        checkpoint = {
            k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
        }
        assert self.lightning_module is not None
        if self._async is not None:
            self._async.save(path, self.lightning_module, self._raw_optimizers(), checkpoint)
            state = self.lightning_module.trainer.state
            if state.fn != TrainerFn.FITTING or state.status != TrainerStatus.RUNNING:
                # Outside a running fit (trainer.save_checkpoint after fit) no later save or
                # teardown would wait for it: the checkpoint must be complete on return.
                self._async.wait()
            return
        ckpt.save_checkpoint(path, self.lightning_module, self._raw_optimizers(), checkpoint)

    @override
    def load_checkpoint(
        self, checkpoint_path: _PATH, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.lightning_module is not None
        if self._async is not None:
            self._async.wait()  # it may be the checkpoint still being written
        if path.is_file():  # a full checkpoint (state_dict_type="full", or consolidated)
            module = self.lightning_module
            return checkpointing.load_full_file(
                path, module, self._raw_optimizers(), weights_only, module.strict_loading
            )
        trusted = trust.trusted_types(dict(self.lightning_module.hparams))  # built here already
        return ckpt.load_checkpoint(path, self.lightning_module, self._raw_optimizers(), trusted)

    @override
    def teardown(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._async is not None:
            self._async.wait()  # the last checkpoint is complete when fit returns
        super().teardown()
        if trainer is not None:
            settings.check_trained(trainer)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self._async is not None:  # not before the save that replaces it is complete
            self._async.remove(filepath)
        elif self.is_global_zero:
            commit.remove(filepath)

    def _raw_optimizers(self) -> list[torch.optim.Optimizer]:
        return [getattr(o, "_optimizer", o) for o in self.optimizers]

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="ZeroPP: pipeline parallelism over FSDP2"
        )

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective (call it on every rank, e.g. after `trainer.fit`): the pipelined network's
        whole state, every stage and shard, as CPU tensors under the unsplit network's names
        (no LightningModule attribute prefix), on global rank 0; an empty dict elsewhere. Feed it
        to an exporter such as `lightning_zeropp.models.hf.export_hf`."""
        return export.full_state_dict(self.engine.module, self.engine.dims)


# Every call that communicates runs under the failure board: a rank failing or lost in it is
# named on every rank (`core.step.failure`), as inside a training step.
for _name in (
    "setup",
    "training_step",
    "validation_step",
    "test_step",
    "predict_step",
    "barrier",
    "broadcast",
    "reduce",
    "all_gather",
    "save_checkpoint",
    "load_checkpoint",
    "lightning_module_state_dict",
    "optimizer_state",
    "remove_checkpoint",
    "teardown",
):
    setattr(ZeroPPStrategy, _name, guarded(getattr(ZeroPPStrategy, _name)))

if "zeropp" not in StrategyRegistry:
    ZeroPPStrategy.register_strategies(StrategyRegistry)
