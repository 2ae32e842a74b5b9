"""LightningModules whose network is built on the meta device, as Lightning users write them for
sharded strategies: in `configure_model`, or under `trainer.init_module(empty_init=True)`."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.models import GPT
from tests.distributed.common import GLOBAL_BATCH, MODEL, make_batches
from tests.distributed.meta_scenarios import INIT_SEED, NanoGPT, llama_config

_WORLD_SIZE = int(os.environ["WORLD_SIZE"])


class LazyGPT(pl.LightningModule):
    """Builds its network in `configure_model`, the hook Lightning documents for large models."""

    def __init__(self) -> None:
        super().__init__()
        self.model: GPT | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.1)


class LazyNano(LazyGPT):
    def configure_model(self) -> None:
        if self.model is None:
            self.model = NanoGPT()


class HFCausalLM(pl.LightningModule):
    """A plain HF model built in `__init__` (under `trainer.init_module(empty_init=True)`)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(llama_config())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.1)


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.logged: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.logged.append(float(trainer.callback_metrics["train_loss"]))


def fit_cases(cases: list[dict[str, Any]]) -> dict[str, Any]:
    return {case.pop("id"): _fit(**case) for case in cases}


def _fit(module: str, layout: dict[str, Any], load_from: str | None = None) -> dict[str, Any]:
    torch.manual_seed(INIT_SEED)  # what seed_everything does on every rank
    strategy = ZeroPPStrategy(load_from=load_from, **layout)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=_WORLD_SIZE,
        strategy=strategy,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    if module == "gpt":
        lit = LazyGPT()
    elif module == "nano":
        lit = LazyNano()
    else:
        with trainer.init_module(empty_init=True):
            lit = HFCausalLM()
    built_on_meta = all(p.is_meta for p in lit.parameters())
    losses = Losses()
    trainer.callbacks.append(losses)
    trainer.fit(lit, _loader(_WORLD_SIZE // (layout.get("pp_size") or 1)))
    params = {n: _full(p) for n, p in lit.model.named_parameters()}
    return {"losses": losses.logged, "params": params, "built_on_meta": built_on_meta}


def _loader(dp: int) -> DataLoader:
    batches = make_batches(3)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    return DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // dp, drop_last=True)


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
