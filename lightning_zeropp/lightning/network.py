"""The network a LightningModule holds, as `ZeroPPStrategy` sees it: which child is pipelined,
one micro-batch of its inputs (for splits that need one), and Lightning's model summary of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_zeropp.core.step.batch import batch_size, take_rows
from lightning_zeropp.lightning.redirect import first_batch
from lightning_zeropp.lightning.steps import StepRunner

__all__ = ["example_microbatch", "pipelined_name", "summarize_whole_model"]


def pipelined_name(module: pl.LightningModule, module_name: str | None) -> str:
    """The attribute of `module` holding the network: `module_name`, or its only child module
    that holds parameters."""
    holders = [n for n, c in module.named_children() if any(True for _ in c.parameters())]
    if module_name is not None:
        if not isinstance(getattr(module, module_name, None), nn.Module):
            raise ValueError(
                f"module_name={module_name!r} is not a submodule of {type(module).__name__}, "
                f"whose submodules with parameters are {holders}; pass "
                "ZeroPPStrategy(module_name=...) the one to pipeline."
            )
        return module_name
    if len(holders) != 1:
        raise ValueError(
            f"{type(module).__name__} has {len(holders)} child modules with parameters "
            f"({holders}); ZeroPPStrategy pipelines one. Pass module_name='<attribute>'."
        )
    return holders[0]


def example_microbatch(
    module: pl.LightningModule,
    trainer: pl.Trainer,
    runner: StepRunner,
    microbatches: int,
    to_device: Callable[[Any], Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """One micro-batch of the network's inputs: what the module's forward passes to the network
    for `example_input_array` (taken as one micro-batch), or else what the step passes to it for
    the first batch (cut to one micro-batch)."""
    runner.adapter.microbatches = microbatches
    example = module.example_input_array
    if example is not None:
        args = tuple(example) if isinstance(example, (tuple, list)) else (example,)
        kw = example if isinstance(example, dict) else {}
        return runner.capture(lambda: module(*([] if kw else args), **kw))
    step = {
        TrainerFn.FITTING: module.training_step,
        TrainerFn.VALIDATING: module.validation_step,
        TrainerFn.TESTING: module.test_step,
        TrainerFn.PREDICTING: module.predict_step,
    }[trainer.state.fn]
    batch = to_device(first_batch(trainer))
    inputs, kw = runner.capture(lambda: step(batch, 0))
    rows = torch.arange(max(1, batch_size((inputs, kw)) // microbatches))
    return take_rows(inputs, rows), take_rows(kw, rows)


def summarize_whole_model(trainer: pl.Trainer, name: str, whole: nn.Module) -> None:
    """Lightning's model summary would count this rank's stages; show it the whole network
    (a meta-device copy: parameter counts, no memory) while it summarizes."""
    for callback in trainer.callbacks:
        if not isinstance(callback, ModelSummary):
            continue
        summarize = getattr(callback, "_zeropp_summarize", callback.on_fit_start)

        def on_fit_start(trainer: pl.Trainer, pl_module: pl.LightningModule, f=summarize) -> None:
            stages = pl_module._modules[name]
            pl_module._modules[name] = whole
            try:
                f(trainer, pl_module)
            finally:
                pl_module._modules[name] = stages

        callback._zeropp_summarize = summarize
        callback.on_fit_start = on_fit_start
