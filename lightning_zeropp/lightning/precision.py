"""The Lightning precision plugin of `ZeroPPStrategy`: fp32 in Lightning (mixed precision is FSDP2's,
`ZeroPPStrategy(param_dtype="bf16")`), a backward that releases the gradients the pipeline step
computed, clipping by the global norm over every stage and shard, and the hooks around backward
and the optimizer step checked for reads of this rank's shards (`lightning.hooks`).

The plugin knows nothing of the strategy: it is given a `HeldGradients`, which the strategy fills
(a step's gradients, the engine once built) and the plugin empties (backward, clipping)."""

from __future__ import annotations

from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer import call
from typing_extensions import override

from lightning_zeropp.core.step.grads import StepGrads
from lightning_zeropp.lightning.hooks import ShardReads

__all__ = ["GradNorm", "HeldGradients", "ZeroPPPrecision", "zeropp_precision"]


class GradNorm(Protocol):
    """What clipping needs of the engine: the norm over every stage and shard, clipped."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor: ...


class HeldGradients:
    """A training step's gradients, held from the pipeline step until Lightning's `backward`
    (Lightning zeroes gradients between `training_step` and `backward`), and the engine whose
    global norm clipping uses."""

    def __init__(self) -> None:
        self._pending: tuple[StepGrads, torch.Tensor | float] | None = None
        self.engine: GradNorm | None = None

    def hold(self, grads: StepGrads, scale: torch.Tensor | float) -> None:
        """Keep a step's gradients and what they are worth until backward."""
        self._pending = (grads, scale)

    def release(self, accumulate: int) -> None:
        """Apply the held gradients: Lightning's mean over `accumulate` batches."""
        if self._pending is not None:
            grads, scale = self._pending
            grads.apply(scale / accumulate)
            self._pending = None

    def clip(self, max_norm: float) -> None:
        if self.engine is None:
            raise RuntimeError("the ZeroPP engine exists only after the strategy's setup()")
        self.engine.clip_grad_norm_(max_norm)


class ZeroPPPrecision(Precision):
    """fp32 Lightning precision whose backward releases the pipeline's gradients and whose norm
    clipping uses the global norm over all stages and shards (mixed precision is FSDP2's job:
    `ZeroPPStrategy(param_dtype="bf16")`)."""

    def __init__(self, grads: HeldGradients) -> None:
        super().__init__()
        self._grads = grads

    @override
    def backward(self, tensor: torch.Tensor, model: pl.LightningModule, *args: Any, **kwargs: Any):  # type: ignore[override]  # as Lightning's own
        self._grads.release(model.trainer.accumulate_grad_batches)

    @override
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        self._grads.clip(clip_val)

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


def zeropp_precision(plugin: Precision | None, grads: HeldGradients) -> ZeroPPPrecision | None:
    """The strategy's plugin for the one Lightning's connector gives it: fp32 only (None stays
    None); any other is refused, naming FSDP2's mixed precision instead."""
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
    return None if plugin is None else ZeroPPPrecision(grads)
