"""The embedded default as a LightningModule: the bundled GPT on the bundled Markov language.

Written as any LightningModule is; nothing in it knows about pipelines. The only nod to the
strategy is `example_input_array` (one micro-batch of inputs), which the tracing splitter uses.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from lightning_zeropp.models.gpt import GPT, GPTConfig

__all__ = ["LitGPT"]


class LitGPT(pl.LightningModule):
    def __init__(
        self,
        model: GPTConfig | None = None,
        *,
        micro_batch_size: int = 1,
        optimizer: str = "adamw",
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        max_steps: int = 0,
    ) -> None:
        super().__init__()
        self.cfg = model or GPTConfig()
        self.model = GPT(self.cfg)
        self.example_input_array = torch.zeros(micro_batch_size, self.cfg.seq_len, dtype=torch.long)
        self.optimizer_name, self.lr, self.weight_decay = optimizer, lr, weight_decay
        self.warmup_steps, self.max_steps = warmup_steps, max_steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)  # (batch, time, vocab)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.AdamW(
                self.parameters(), lr=self.lr, eps=1e-6, weight_decay=self.weight_decay
            )
        if not self.max_steps:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self._lr_factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _lr_factor(self, step: int) -> float:
        """Linear warm-up, then cosine decay to 10%."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
