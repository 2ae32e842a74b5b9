"""`ZeroPPStrategy`: Lightning's words translated to the core, in one place.

How an unmodified LightningModule trains under a pipeline:
- at setup, the module's network (its one child holding every trainable parameter, e.g.
  `self.model`, or else the module itself through its own `forward`: `lightning.network`) is
  split, sharded and replaced by this rank's stages (`lightning.build`);
- `training_step` (the strategy's) runs the user's step once per micro-batch, on every rank, up
  to its network call, and the pipeline schedule on the calls' inputs; on the last stage each
  micro-batch's step goes on from its network call with the pipeline's output: the loss
  (`lightning.steps`, `lightning.continuation`), weighted by its items when it is a mean over
  them (`lightning.weighting`);
- the gradients the schedule produced are set aside until Lightning's `backward`, because Lightning
  zeroes gradients between `training_step` and `backward`;
- what the user logs per micro-batch is combined, sent from the last stage to every stage, and
  logged on every rank, so rank 0's loggers and `sync_dist=True` see the real values
  (`lightning.logging`).
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
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_zeropp.core.engine import ZeroPPEngine
from lightning_zeropp.core.mesh import ParallelDims, build_mesh
from lightning_zeropp.core.settings import launch
from lightning_zeropp.core.settings.config import ZeroPPConfig, ZeroPPLayout
from lightning_zeropp.core.split.methods import SplitMethod
from lightning_zeropp.core.step.agree import agree, settings_fields
from lightning_zeropp.core.step.failure import failure_guard, guarded
from lightning_zeropp.core.weights import export
from lightning_zeropp.core.weights.materialize import InitFn, empty_parameters
from lightning_zeropp.fronts.settings import takes_settings
from lightning_zeropp.lightning import checkpointing, data, hooks, preempt
from lightning_zeropp.lightning.build import build_engine
from lightning_zeropp.lightning.precision import HeldGradients, zeropp_precision
from lightning_zeropp.lightning.settings import strategy_settings
from lightning_zeropp.lightning.steps import StepRunner
from lightning_zeropp.lightning.weighting import UNWEIGHTED, GlobalTokenCount

__all__ = ["ZeroPPStrategy"]


class ZeroPPStrategy(ModelParallelStrategy):
    """Pipeline parallelism over FSDP2 for an unmodified LightningModule.

    Settings (keyword arguments) are `ZeroPPConfig`'s fields: `pp_size`, `dp_shard_size`,
    `dp_replicate_size`, `num_microbatches`, `schedule`, `num_chunks`, `param_dtype`, ... (see
    `ZeroPPConfig` and the settings page, docs/settings.md). One left out (None) takes its `ZEROPP_*`
    variable when set, else `ZeroPPConfig`'s default; one given wins over its variable, as in
    every front (`fronts.settings`); a misspelt one is a `TypeError` naming the closest. Plus:
        split: "auto" (default: "call" unless the model names another), "call" (the network's
            own forward cut at its block calls; input shapes are read from the first batch, or
            from `example_input_array` if set), "trace" (torch.export; one micro-batch of fixed
            shape), "stack", or a callable (see `lightning_zeropp.core.split`). Left out:
            `ZEROPP_SPLIT`, else "auto".
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
            every rank has written it (`core.weights.async_checkpoint`); a save waits for the
            last one.
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

    @takes_settings
    def __init__(
        self,
        *,
        split: SplitMethod | None = None,
        module_name: str | None = None,
        timeout: datetime.timedelta = datetime.timedelta(minutes=30),
        process_group_backend: str | None = None,
        log_comms: bool = False,
        state_dict_type: str = "sharded",
        async_save: bool = False,
        load_from: str | Path | None = None,
        init: InitFn | None = None,
        **settings: Any,
    ) -> None:
        launch.check_timeout(timeout)
        # One path for every front: these arguments over the ZEROPP_* variables; the layout is
        # resolved at setup, when the world size is known (`lightning.settings`).
        self._settings = strategy_settings(settings, split)
        self._config: ZeroPPConfig = self._settings.config
        # the settings resolved for the launched world, at `setup_environment`: what every part
        # below the strategy is handed
        self.layout: ZeroPPLayout | None = None
        self._split = self._settings.split
        self._checkpoints = checkpointing.StrategyCheckpoints(state_dict_type, async_save)
        # the last training step's gradients and what they are worth, until backward (the
        # precision plugin releases them); before Strategy.__init__ sets the plugin
        self._grads = HeldGradients()
        super().__init__(
            save_distributed_checkpoint=state_dict_type == "sharded",
            timeout=timeout,
            process_group_backend=process_group_backend,
        )
        self._log_comms = log_comms
        self._load_from, self._init = load_from, init
        self._module_name = module_name
        self._dims: ParallelDims | None = None
        self._engine: ZeroPPEngine | None = None
        self._runner = StepRunner()
        self._told = False  # whether rank 0 said how the loss is weighted

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

    @property
    def zeropp_config(self) -> ZeroPPConfig:
        """The settings as given: the arguments over the `ZEROPP_*` variables, unresolved (sizes
        left to the world may be None). Resolved at setup, they are `layout`."""
        return self._config

    def _layout(self) -> ZeroPPLayout:
        assert self.layout is not None  # setup_environment resolved it
        return self.layout

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # A fit resumed mid-epoch continues with the next unseen batch (`lightning.data`).
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        assert self._dims is not None
        data.check_batch_size(trainer, dataloader, self._dims, self._layout().num_microbatches)
        return data.resuming_loader(dataloader, trainer, lambda: self._checkpoints.saved_rows)

    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = zeropp_precision(plugin, self._grads)

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
        launches = self._launcher is not None and "MASTER_PORT" in os.environ
        if launches and env_ is not None and env_.node_rank() == 0:
            # This process starts the ranks and hosts their store: a busy port would leave
            # the ranks it starts waiting on whatever holds it.
            launch.check_port_free(env_.main_address, env_.main_port)

    @override
    def setup_environment(self) -> None:
        # SIGTERM is the library's from here on: Lightning's handler broadcasts inside it.
        assert self.lightning_module is not None
        preempt.take_over_signals(self.lightning_module.trainer)
        # Validate on every rank before the process group exists: a bad size fails everywhere.
        world_size = self.num_nodes * self.num_processes
        self.layout = layout = self._settings.resolve(world_size)
        launch.check_restart()
        timeout = self._timeout.total_seconds() if self._timeout else 1800.0
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        with launch.join_deadline(timeout + 30, f"joining the process group (store at {where})"):
            self._setup_distributed()
        # Ranks that resolved other settings (a ZEROPP_* variable set on one node) stop here.
        with failure_guard():
            agree(settings_fields(layout))
            if self._dims is None:  # fit then validate on one Trainer sets up twice: one mesh
                self._dims = build_mesh(layout, self.root_device.type, self.root_device)
            assert self.lightning_module is not None
            checkpointing.recover_last(self.lightning_module.trainer)
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
        network = self._runner.network  # set by build_engine, with the engine
        if self._engine is None or network is None or not network.installed(self._engine.module):
            assert self._dims is not None
            self._engine = build_engine(
                self._runner,
                module,
                trainer,
                self._layout(),
                self._dims,
                split=self._split,
                module_name=self._module_name,
                device=self.root_device,
                count_comms=self._log_comms,
                init=self._init,
                load_from=self._load_from,
                to_device=self.batch_to_device,
            )
            self._grads.engine = self._engine
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self.engine.report_memory_after_first_update(self.optimizers, rank_zero_info)
        hooks.count_pipelines(trainer, self.engine.dims.dp_size)
        self.setup_precision_plugin()

    # ---------------------------------------------------------------- steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor | dict[str, Any]:
        assert self.lightning_module is not None
        # Lightning zeroes the previous step's gradients (unless accumulating) only after
        # training_step, and expects this step's gradients to appear in backward: the engine
        # holds them (`StepGrads`) until then.
        with self._stopping():
            outcome = self._runner.run(self.lightning_module.training_step, args, "train")
        assert outcome.grads is not None
        if outcome.skipped:  # the step returned None: no gradient from this batch, anywhere
            outcome.grads.discard()
        else:
            self._grads.hold(outcome.grads, outcome.grad_scale)
        self._tell_weighting()
        if self._log_comms:
            self.lightning_module.log_dict(self.engine.comm_metrics(), on_step=True, on_epoch=False)
        loss = outcome.loss.detach().requires_grad_(True)
        return {"loss": loss, **outcome.extras} if outcome.extras else loss

    def _tell_weighting(self) -> None:
        """Once, on rank 0: a loss the library cannot weight by its items is averaged as given."""
        runner, cfg = self._runner, self._layout()
        if self._told or runner.weighted is not False:
            return
        self._told = True
        several = cfg.num_microbatches > 1 or self.engine.dims.dp_size > 1
        if several and not isinstance(runner.adapter, GlobalTokenCount):
            rank_zero_info(UNWEIGHTED.format(micro=cfg.num_microbatches))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None
        with self._stopping():
            return self._runner.run(self.lightning_module.validation_step, args, "eval").loss

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None
        with self._stopping():
            return self._runner.run(self.lightning_module.test_step, args, "eval").loss

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's predict_step per micro-batch on the last stage; the batch's predictions
        (tensors concatenated along rows) on every rank of the pipeline."""
        assert self.lightning_module is not None
        with self._stopping():
            return self._runner.run(self.lightning_module.predict_step, args, "predict").predictions

    def _stopping(self) -> contextlib.AbstractContextManager[None]:
        """SIGTERM agreed on in the step: save (`save_on_sigterm`), name it, exit 143."""
        assert self.lightning_module is not None
        trainer, save = self.lightning_module.trainer, self._layout().save_on_sigterm
        return preempt.stopping(trainer, save, self.engine.failures.description)

    @override
    def on_train_end(self) -> None:
        # A SIGTERM during the last step or save: no later step agrees on it.
        assert self.lightning_module is not None
        trainer, save = self.lightning_module.trainer, self._layout().save_on_sigterm
        preempt.agree_at_end(trainer, self.root_device, save, self.engine.failures.description)

    # ---------------------------------------------------------------- checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._checkpoints.sharded:
            return {}  # model state is written by save_checkpoint through DCP, sharded
        # Collective: the LightningModule's whole state_dict (its own names) on global rank 0.
        assert self.lightning_module is not None
        return export.full_state_dict(self.lightning_module, self.engine.dims)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self._checkpoints.sharded:
            return {}  # likewise
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        assert self.lightning_module is not None
        return export.full_optimizer_state_dict(self.lightning_module, optimizer, self.engine.dims)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("ZeroPPStrategy.save_checkpoint does not take storage_options")
        path = Path(self.broadcast(str(filepath)))
        assert self.lightning_module is not None
        self._checkpoints.save(path, self.lightning_module, self._raw_optimizers(), checkpoint)

    @override
    def load_checkpoint(
        self, checkpoint_path: _PATH, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.lightning_module is not None
        return self._checkpoints.load(path, self.lightning_module, self._raw_optimizers())

    @override
    def teardown(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self._checkpoints.wait()  # the last checkpoint is complete when fit returns
        super().teardown()
        if trainer is not None:
            data.check_trained(trainer)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        self._checkpoints.remove(filepath, self.is_global_zero)

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
