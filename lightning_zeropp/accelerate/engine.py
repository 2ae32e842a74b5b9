"""`ZeroPPAccelerateEngine`: this rank's pipeline stages as an Accelerate loop drives them.

Steps through the core engine (with Accelerate's gradient-accumulation scaling), global-norm
clipping, extra loaders sharded like the training data, and the sharded model + optimizer
checkpoint that `accelerator.save_state` / `load_state` write and read through their pre-hooks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_zeropp.accelerate.data import Unpack, check_loader, shard_loader, widen_loader
from lightning_zeropp.core.engine import ZeroPPEngine
from lightning_zeropp.core.mesh import ParallelDims
from lightning_zeropp.core.settings.resolve import ZeroPPLayout
from lightning_zeropp.core.weights import checkpoint as ckpt

__all__ = ["CHECKPOINT_DIR", "ZeroPPAccelerateEngine"]

CHECKPOINT_DIR = "zeropp"  # the sharded model + optimizer checkpoint inside save_state's folder


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
        args, kwargs, target = self._unpack(batch)
        loss, grads = self.core.train_step_deferred(*args, target=target, **kwargs)
        # This batch's gradients times 1/k, as accelerator.backward scales the loss.
        grads.apply(1.0 / self.accelerator.gradient_accumulation_steps)
        return loss

    def eval_step(self, batch: Any) -> torch.Tensor:
        """Forward only through the pipeline; the global mean loss on every rank."""
        args, kwargs, target = self._unpack(batch)
        loss = self.core.eval_step(*args, target=target, **kwargs)
        assert loss is not None  # a target was given
        return loss

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
        meta = {"zeropp_config": _plain(self.config), "world_size": dist.get_world_size()}
        with _nonempty_groups(self.optimizer):
            return ckpt.save_checkpoint(
                Path(output_dir) / CHECKPOINT_DIR, self.module, [self.optimizer], meta
            )

    def load(self, input_dir: str | os.PathLike[str]) -> dict[str, Any]:
        """Collective: read what `save` wrote (under any layout: names are the model's own)."""
        path = Path(input_dir) / CHECKPOINT_DIR
        if not ckpt.is_checkpoint(path):
            raise FileNotFoundError(
                f"{input_dir} holds no ZeroPP checkpoint ({path} is missing); save it with "
                "accelerator.save_state after prepare_pipeline."
            )
        with _nonempty_groups(self.optimizer):
            meta = ckpt.load_checkpoint(path, self.module, [self.optimizer])
        _fill_empty_groups(self.optimizer)
        return meta

    def _register_hooks(self) -> None:
        acc = self.accelerator
        self._hooks = [
            acc.register_save_state_pre_hook(lambda models, weights, out: self.save(out)),
            acc.register_load_state_pre_hook(lambda models, inp: self.load(inp)),
        ]


# ------------------------------------------------------------------------------------ checkpoints
@contextlib.contextmanager
def _nonempty_groups(optimizer: Optimizer) -> Iterator[None]:
    """Hide param groups that are empty on this rank from the distributed checkpoint.

    Groups stay aligned across ranks, so a group may hold no parameter of this rank's stages;
    torch's flattened optimizer state dict cannot load such a group (it reads the group's
    hyperparameters from its first parameter). Loading replaces the group dicts it sees, so the
    full list is rebuilt from the loaded ones afterwards.
    """
    groups = optimizer.param_groups
    optimizer.param_groups = [g for g in groups if g["params"]]
    try:
        yield
    finally:
        loaded = iter(optimizer.param_groups)
        optimizer.param_groups = [next(loaded) if g["params"] else g for g in groups]


def _fill_empty_groups(optimizer: Optimizer) -> None:
    """Give groups that are empty here the hyperparameters another rank loaded for them.

    The checkpoint keeps a group's hyperparameters (its learning rate, ...) with its parameters,
    so a rank holding none of them has nothing to load. Schedulers that update the learning rate
    from its current value (cosine annealing's recursive form) would then drift on that rank.
    """
    mine = [
        {k: v for k, v in g.items() if k != "params"} if g["params"] else None
        for g in optimizer.param_groups
    ]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for i, group in enumerate(optimizer.param_groups):
        if not group["params"]:
            loaded = next((r[i] for r in everyone if r[i] is not None), None)
            if loaded is not None:
                group.update(loaded)


def _plain(config: ZeroPPLayout) -> dict[str, Any]:
    """The config as plain values (dtypes as strings) for the checkpoint's metadata."""
    return {k: str(v) if isinstance(v, torch.dtype) else v for k, v in vars(config).items()}
