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
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

from lightning_zeropp.core import checkpoint as ckpt
from lightning_zeropp.core import export
from lightning_zeropp.core.batch import ShapeGuard, batch_size, take_rows
from lightning_zeropp.core.call_adapter import get_call_adapter
from lightning_zeropp.core.config import ZeroPPConfig
from lightning_zeropp.core.engine import ZeroPPEngine
from lightning_zeropp.core.grads import GradStash
from lightning_zeropp.core.mesh import ParallelDims, build_mesh
from lightning_zeropp.core.split import SplitMethod
from lightning_zeropp.lightning.logging import LogRecorder

__all__ = ["ZeroPPStrategy"]


class _Captured(Exception):
    """Raised by the redirected forward on the first stage to hand back the model inputs."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


class _Redirect(nn.Module):
    """Stands in for the pipelined module while a user step runs: calls `fn`, no FSDP hooks."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


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
    reshard_after_forward, split_points, unit_size, split_backward, grad_reduce), plus:
        split: "trace" (default; needs `example_input_array` set to one micro-batch of model
            inputs), "stack", or a callable (see `lightning_zeropp.core.split`).
        module_name: the LightningModule attribute to pipeline (default: its only child module
            that holds parameters).
        timeout: for every process group.
        log_comms: log every training step's collectives as metrics
            `comm/{kind}/{axis}/count|bytes` (per rank, averaged over ranks; see
            `ZeroPPEngine.comm_metrics`).

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
        dp_replicate_size: int = 1,
        num_microbatches: int | None = None,
        schedule: str = "1f1b",
        num_chunks: int | None = None,
        param_dtype: str | torch.dtype | None = None,
        reduce_dtype: str | torch.dtype | None = None,
        activation_checkpointing: bool | str = False,
        reshard_after_forward: bool | None = None,
        split_points: list[int] | None = None,
        unit_size: int | None = None,
        split_backward: bool | None = None,
        grad_reduce: str = "step",
        split: SplitMethod = "trace",
        module_name: str | None = None,
        timeout: datetime.timedelta = datetime.timedelta(minutes=30),
        process_group_backend: str | None = None,
        log_comms: bool = False,
    ) -> None:
        super().__init__(timeout=timeout, process_group_backend=process_group_backend)
        self.zeropp_config = ZeroPPConfig(
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
        )
        self._log_comms = log_comms
        self._split = split
        self._module_name = module_name
        self._pipelined: str | None = None  # the LightningModule attribute that was pipelined
        self._dims: ParallelDims | None = None
        self._engine: ZeroPPEngine | None = None
        self._stash = GradStash()
        self._recorder = LogRecorder()
        self._shapes = ShapeGuard()
        self._step: tuple[Callable[..., Any], Any, tuple[Any, ...]] | None = None

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
    def setup_environment(self) -> None:
        # Validate on every rank before the process group exists: a bad size fails everywhere.
        world_size = self.num_nodes * self.num_processes
        self.zeropp_config = self.zeropp_config.resolve(world_size)
        self._setup_distributed()
        if self._dims is None:  # fit then validate on one Trainer sets up twice: keep one mesh
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
        name = self._pipelined_name(module)
        if self._engine is None or module._modules[name] is not self._engine.module:
            self._build_engine(module, name)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _build_engine(self, module: pl.LightningModule, name: str) -> None:
        """Split, shard and schedule the module's network; put this rank's stages in its place."""
        # How the user's calls of the network map to stage inputs and outputs (e.g. HF's `labels=`
        # and `.logits`); read now, since the stages that replace the network do not carry it.
        self._call_adapter = get_call_adapter(getattr(module, name))
        self._engine = ZeroPPEngine(
            getattr(module, name),
            self.zeropp_config,
            loss_fn=self._scheduled_loss,
            probe_loss_fn=self._probe_loss,
            split=self._split,
            example_args=self._example_args(module),
            device=self.root_device,
            dims=self._dims,
            count_comms=self._log_comms,
        )
        module._modules[name] = self._engine.module
        self._pipelined = name
        # The example served the tracer. Lightning's model summary would feed it to this rank's
        # stages as if they were the whole model, so it goes.
        module.example_input_array = None

    def _pipelined_name(self, module: pl.LightningModule) -> str:
        if self._module_name is not None:
            if not isinstance(getattr(module, self._module_name, None), nn.Module):
                raise ValueError(
                    f"module_name={self._module_name!r} is not a submodule of {type(module).__name__}"
                )
            return self._module_name
        holders = [n for n, c in module.named_children() if any(True for _ in c.parameters())]
        if len(holders) != 1:
            raise ValueError(
                f"{type(module).__name__} has {len(holders)} child modules with parameters "
                f"({holders}); ZeroPPStrategy pipelines one. Pass module_name='<attribute>'."
            )
        return holders[0]

    def _example_args(self, module: pl.LightningModule) -> tuple[Any, ...] | None:
        example = module.example_input_array
        if example is None:
            return None
        return tuple(example) if isinstance(example, (tuple, list)) else (example,)

    # ---------------------------------------------------------------- steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.lightning_module is not None
        # Lightning zeroes the previous step's gradients (unless accumulating) only after
        # training_step, and expects this step's gradients to appear in backward. So: set the
        # previous ones aside while the schedule runs, keep the new ones until backward, and hand
        # the previous ones back for Lightning to zero or keep.
        params = list(self.engine.parameters())
        previous = GradStash()
        previous.hold(params)
        loss = self._run(self.lightning_module.training_step, args, train=True)
        self._stash.hold(params)
        previous.release()
        if self._log_comms:
            self.lightning_module.log_dict(self.engine.comm_metrics(), on_step=True, on_epoch=False)
        return loss.detach().requires_grad_(True)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None
        return self._run(self.lightning_module.validation_step, args, train=False)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None
        return self._run(self.lightning_module.test_step, args, train=False)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("ZeroPPStrategy does not support predict yet; use validate/test.")

    def _release_gradients(self) -> None:
        assert self.lightning_module is not None
        self._stash.release(scale=1.0 / self.lightning_module.trainer.accumulate_grad_batches)

    def _run(self, step_fn: Callable[..., Any], args: tuple[Any, ...], train: bool) -> torch.Tensor:
        batch, rest = args[0], args[1:]
        rows = torch.arange(batch_size(batch), device=self.root_device)
        # Every rank holds the whole batch: check its shapes here, since only the first stage sees
        # the model inputs the engine checks (the engine checks divisibility on `rows` everywhere).
        self._shapes.check("train" if train else "eval", batch)
        self._step = (step_fn, batch, rest)
        # Every rank runs the step up to its model call (cheap: it holds the whole batch), so a
        # step that never calls the model fails on every rank, not only on the first stage's
        # while the others wait in the pipeline's first receive.
        inputs, kw = self._capture_inputs()
        if not self.engine.holds_first:
            inputs, kw = (), {}
        with self._recorder.recording(self.lightning_module):
            run = self.engine.train_step if train else self.engine.eval_step
            loss = run(*inputs, target=rows, **kw)
        self._recorder.replay(self.lightning_module, self.engine)
        self._step = None
        return loss

    def _capture_inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Run the user's step until it calls the model; return what it passed (whole batch)."""

        def capture(*args: Any, **kwargs: Any) -> Any:
            raise _Captured(args, kwargs)

        step_fn, batch, rest = self._step
        with self._redirected(capture), self._recorder.muted(self.lightning_module):
            try:
                step_fn(batch, *rest)
            except _Captured as got:
                return self._call_adapter.stage_inputs(got.args, got.kwargs)
        raise RuntimeError(
            f"{step_fn.__name__} never called the model (self(...) or self.{self._pipelined}(...)); "
            "ZeroPPStrategy feeds the pipeline with what the step passes to it."
        )

    def _scheduled_loss(self, output: Any, rows: torch.Tensor) -> torch.Tensor:
        """The user's step on one micro-batch, with the model's output already computed."""
        step_fn, batch, rest = self._step
        adapter = self._call_adapter

        def returned(*args: Any, **kwargs: Any) -> Any:
            return adapter.stage_output(output, args, kwargs)

        with self._redirected(returned), self._recorder.microbatch(len(rows)):
            result = step_fn(take_rows(batch, rows), *rest)
        return _loss_of(result, output)

    def _probe_loss(self, output: Any, rows: torch.Tensor) -> torch.Tensor:
        """The runtime's shape-inference call: same computation, nothing logged."""
        with self._recorder.muted(self.lightning_module):
            return self._scheduled_loss(output, rows)

    @contextlib.contextmanager
    def _redirected(self, fn: Callable[..., Any]) -> Iterator[None]:
        module = self.lightning_module
        assert module is not None
        real = module._modules[self._pipelined]
        module._modules[self._pipelined] = _Redirect(fn)
        module.forward = fn  # instance attribute: `self(x)` goes to `fn` too
        try:
            yield
        finally:
            module._modules[self._pipelined] = real
            del module.forward

    # ---------------------------------------------------------------- checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # model state is written by save_checkpoint through DCP, sharded

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}  # likewise

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("ZeroPPStrategy.save_checkpoint does not take storage_options")
        checkpoint = {
            k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
        }
        path = Path(self.broadcast(str(filepath)))
        assert self.lightning_module is not None
        ckpt.save_checkpoint(path, self.lightning_module, self._raw_optimizers(), checkpoint)

    @override
    def load_checkpoint(
        self, checkpoint_path: _PATH, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.lightning_module is not None
        return ckpt.load_checkpoint(path, self.lightning_module, self._raw_optimizers())

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

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


def _loss_of(result: Any, output: Any) -> torch.Tensor:
    """The loss a user step returned (tensor or {'loss': ...}); eval steps may return nothing."""
    if isinstance(result, dict):
        result = result.get("loss")
    if result is None:
        # Validation steps often return nothing; the runtime still wants a scalar.
        return torch.zeros((), device=_device_of(output))
    return result


def _device_of(output: Any) -> torch.device:
    return output.device if torch.is_tensor(output) else torch.device("cpu")


if "zeropp" not in StrategyRegistry:
    ZeroPPStrategy.register_strategies(StrategyRegistry)
