"""`ZeroPPAccelerateEngine`: this rank's pipeline stages as an Accelerate loop drives them.

Steps through the core engine (with Accelerate's gradient-accumulation scaling), global-norm
clipping, extra loaders sharded like the training data, and the sharded model + optimizer
checkpoint (`accelerate.checkpointing`) that `accelerator.save_state` / `load_state` write and
read through their pre-hooks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_zeropp.accelerate import checkpointing
from lightning_zeropp.accelerate.checkpointing import CHECKPOINT_DIR
from lightning_zeropp.accelerate.data import Unpack, check_loader, shard_loader, widen_loader
from lightning_zeropp.core.engine import ZeroPPEngine
from lightning_zeropp.core.mesh import ParallelDims
from lightning_zeropp.core.settings.layout import ZeroPPLayout

__all__ = ["CHECKPOINT_DIR", "ZeroPPAccelerateEngine"]


class ZeroPPAccelerateEngine:
    """This rank's pipeline stages, driven from an Accelerate loop.

    `step(batch)` runs forward and backward of the whole batch through the pipeline schedule and
    returns the global-batch mean loss on every rank (so `accelerator.log` on rank 0 shows it).
    Gradients are added to `.grad` as `accelerator.backward(loss)` would, including its division
    by `gradient_accumulation_steps`. `module` is this rank's stages under the model's own
    parameter names; `core` is the underlying `ZeroPPEngine`.
    """

    def __init__(
        self, accelerator: Accelerator, core: ZeroPPEngine, optimizer: Optimizer, unpack: Unpack
    ) -> None:
        self.accelerator = accelerator
        self.core = core
        self.optimizer = optimizer  # the rebuilt optimizer (unwrapped), for checkpoints
        self._unpack = unpack
        self._hooks: list[Any] = []
        # Batches per data-parallel rank and step, in loader batches (see prepare_pipeline's
        # per_process_batches): pp_size for ZeroPPAccelerator, 1 for prepare_pipeline.
        self.batch_factor = 1
        # What the front keeps in a checkpoint's metadata (`checkpointing.ROWS`, `BATCHES`),
        # and the metadata the last `load_state` read.
        self.record: Callable[[], dict[str, Any]] = dict
        self.loaded: dict[str, Any] = {}

    # ---------------------------------------------------------------- views
    @property
    def module(self) -> nn.Module:
        return self.core.module

    @property
    def dims(self) -> ParallelDims:
        return self.core.dims

    @property
    def config(self) -> ZeroPPLayout:
        return self.core.config

    @property
    def device(self) -> torch.device:
        return self.core.device

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.core.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def train(self, mode: bool = True) -> ZeroPPAccelerateEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroPPAccelerateEngine:
        return self.train(False)

    # ---------------------------------------------------------------- steps
    def step(self, batch: Any) -> torch.Tensor:
        """Forward and backward of `batch` (this data-parallel rank's); the global mean loss."""
        args, kwargs, target = self._unpack(self._shared(batch))
        loss, grads = self.core.train_step_deferred(*args, target=target, **kwargs)
        # This batch's gradients times 1/k, as accelerator.backward scales the loss.
        grads.apply(1.0 / self.accelerator.gradient_accumulation_steps)
        return loss

    def eval_step(self, batch: Any) -> torch.Tensor:
        """Forward only through the pipeline; the global mean loss on every rank."""
        args, kwargs, target = self._unpack(self._shared(batch))
        loss = self.core.eval_step(*args, target=target, **kwargs)
        assert loss is not None  # a target was given
        return loss

    def _shared(self, batch: Any) -> Any:
        """The first stage's batch on every stage of the pipeline (`core.step.pipeline_batch`)."""
        batch = self.core.batches.share(batch)
        self.core.batches.check(batch, "the batch")
        return batch

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over all stages and shards (`accelerator.clip_grad_norm_` would see
        this rank's stages only); returns the norm before clipping."""
        return self.core.clip_grad_norm_(max_norm, norm_type)

    def prepare_data_loader(self, loader: DataLoader, check: bool = True) -> DataLoader:
        """Another loader (e.g. validation) sharded like the training data: over dp ranks only.

        `check=False` for loaders that only evaluate: forward-only steps take any rows."""
        if not self.accelerator.split_batches:
            loader = widen_loader(loader, self.batch_factor)
        if check:
            check_loader(
                loader,
                self.accelerator.split_batches,
                self.dims.dp_size,
                self.config.num_microbatches,
            )
        return shard_loader(self.accelerator, loader, self.dims)

    # ---------------------------------------------------------------- checkpoints
    def save(self, output_dir: str | os.PathLike[str]) -> Path:
        """Collective: write the sharded model and optimizer state to `output_dir/zeropp`."""
        return checkpointing.save_sharded(
            output_dir, self.module, self.optimizer, self.config, self.record()
        )

    def load(self, input_dir: str | os.PathLike[str]) -> dict[str, Any]:
        """Collective: read what `save` wrote (under any layout: names are the model's own)."""
        self.loaded = checkpointing.load_sharded(input_dir, self.module, self.optimizer)
        return self.loaded

    def _register_hooks(self) -> None:
        acc = self.accelerator
        self._hooks = [
            acc.register_save_state_pre_hook(lambda models, weights, out: self.save(out)),
            acc.register_load_state_pre_hook(lambda models, inp: self._load_state(inp)),
        ]

    def _load_state(self, input_dir: str) -> None:
        """The load pre-hook: the folder's files checked as data, then the sharded state."""
        checkpointing.check_state_files(input_dir, self.accelerator.process_index)
        self.load(input_dir)
