"""The Lightning precision plugin of `ZeroPPStrategy`: fp32 in Lightning (mixed precision is FSDP2's,
`ZeroPPStrategy(param_dtype="bf16")`), a backward that releases the gradients the pipeline step
computed, clipping by the global norm over every stage and shard, and the hooks around backward
and the optimizer step checked for reads of this rank's shards (`lightning.hooks`)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer import call
from typing_extensions import override

from lightning_zeropp.lightning.hooks import ShardReads

__all__ = ["ZeroPPPrecision"]


class ZeroPPPrecision(Precision):
    """fp32 Lightning precision whose backward releases the pipeline's gradients and whose norm
    clipping uses the global norm over all stages and shards (mixed precision is FSDP2's job:
    `ZeroPPStrategy(param_dtype="bf16")`)."""

    def __init__(self, strategy: Any) -> None:
        super().__init__()
        self._strategy = strategy

    @override
    def backward(self, tensor: torch.Tensor, model: pl.LightningModule, *args: Any, **kwargs: Any):  # type: ignore[override]  # as Lightning's own
        self._strategy._release_gradients()

    @override
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        self._strategy.engine.clip_grad_norm_(clip_val)

    @override
    def post_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]  # as Lightning's own
        with ShardReads(module, "on_after_backward"):
            return super().post_backward(tensor, module)

    @override
    def _after_closure(self, model: pl.LightningModule, optimizer: Any) -> None:
        # Lightning's own, with the hooks' reads of the model checked (`lightning.hooks`).
        trainer = model.trainer
        with ShardReads(model, "on_before_optimizer_step"):
            call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
            call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        self._clip_gradients(
            model,
            optimizer,
            trainer.gradient_clip_val,
            gradient_clip_algorithm=trainer.gradient_clip_algorithm,
        )
