"""Scenarios run on gloo ranks through `Trainer(strategy=ZeroPPStrategy(...))`."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.models.lit_gpt import LitGPT
from tests.distributed.common import GLOBAL_BATCH, MAX_NORM, MODEL, make_batches, make_model

# Read once: Lightning's cluster environment deletes WORLD_SIZE when a Trainer tears down.
_WORLD_SIZE = int(os.environ["WORLD_SIZE"])


class Record(pl.Callback):
    """What rank 0 would show: the logged loss and the step output, per step."""

    def __init__(self) -> None:
        self.logged: list[float] = []
        self.returned: list[float] = []
        self.comms: dict[str, float] = {}  # the last step's comm/* metrics

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.logged.append(float(trainer.callback_metrics["train_loss"]))
        self.returned.append(float(outputs["loss"]))
        metrics = trainer.callback_metrics.items()
        self.comms = {k: float(v) for k, v in metrics if k.startswith("comm/")}


class DirectLitGPT(LitGPT):
    """A step that calls the network attribute directly instead of `self(x)`."""

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def fit_cases(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Several Trainer.fit runs in one process group, one per case."""
    return {case.pop("id"): fit(**case) for case in cases}


def resume(layout: dict[str, Any], save_to: str) -> dict[str, Any]:
    """Two epochs straight, against one epoch + checkpoint + a fresh Trainer resuming the second."""
    full = fit(layout, optimizer="adamw", max_epochs=2, data_steps=3)
    first = fit(layout, optimizer="adamw", max_epochs=1, data_steps=3, save_to=save_to)
    resumed = fit(
        layout, optimizer="adamw", max_epochs=2, data_steps=3, resume_from=save_to, init_seed=7
    )
    return {"full": full, "first": first, "resumed": resumed}


def fit(
    layout: dict[str, Any],
    optimizer: str = "sgd",
    clip: bool = False,
    steps: int = 3,
    split: str = "auto",
    accumulate: int = 1,
    save_to: str | None = None,
    resume_from: str | None = None,
    max_epochs: int | None = None,
    data_steps: int | None = None,
    validate: bool = False,
    init_seed: int = 0,
    direct: bool = False,
    lr_schedule: tuple[int, int] | None = None,
) -> dict[str, Any]:
    strategy = ZeroPPStrategy(split=split, **layout)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=_world_size(),
        strategy=strategy,
        max_steps=steps if max_epochs is None else -1,
        max_epochs=max_epochs,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=MAX_NORM if clip else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    dp = _world_size() // (layout.get("pp_size") or 1)
    micro = GLOBAL_BATCH // dp // layout.get("num_microbatches", layout.get("pp_size") or 1)
    module = (DirectLitGPT if direct else LitGPT)(
        MODEL, micro_batch_size=micro, optimizer=optimizer, lr=_lr(optimizer)
    )
    module.model.load_state_dict(make_model(init_seed).state_dict())
    record = Record()
    trainer.callbacks.append(record)
    with _pickled_log_broadcasts() as pickled:
        trainer.fit(module, _loader(data_steps or steps * accumulate, dp), ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    val = trainer.validate(module, _loader(steps, dp), verbose=False) if validate else None
    params = {n: _full(p) for n, p in module.model.named_parameters()}
    out = {"logged": record.logged, "returned": record.returned, "params": params}
    out["pickled_log_broadcasts"] = len(pickled)
    if layout.get("log_comms"):
        out |= {"comms_logged": record.comms, "last_comms": strategy.engine.last_comms}
    return out | ({"val_loss": val[0]["val_loss"]} if val else {})


@contextlib.contextmanager
def _pickled_log_broadcasts() -> Iterator[list[int]]:
    """Count the pickled broadcasts the strategy's log replay makes (each pipeline stage)."""
    calls: list[int] = []
    real = dist.broadcast_object_list

    def counting(*args: Any, **kwargs: Any) -> Any:
        if sys._getframe(1).f_code.co_filename.endswith(os.path.join("lightning", "logging.py")):
            calls.append(1)
        return real(*args, **kwargs)

    dist.broadcast_object_list = counting
    try:
        yield calls
    finally:
        dist.broadcast_object_list = real


def _loader(steps: int, dp: int) -> DataLoader:
    batches = make_batches(steps)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    return DataLoader(
        TensorDataset(x, y), batch_size=GLOBAL_BATCH // dp, shuffle=False, drop_last=True
    )


def _lr(optimizer: str) -> float:
    return 0.5 if optimizer == "sgd" else 1e-3


def _world_size() -> int:
    return _WORLD_SIZE


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
