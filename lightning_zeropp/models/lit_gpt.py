"""The embedded default as a LightningModule: the bundled GPT on the bundled Markov language.

Written as any LightningModule is; nothing in it knows about pipelines. The only nod to the
strategy is `example_input_array` (one micro-batch of inputs), which the tracing splitter uses.

Validation also reports token-weighted perplexity and next-token accuracy (`val_perplexity`,
`val_token_accuracy`, see `lightning_zeropp.metrics`): updated in `validation_step` (under
ZeroPPStrategy that runs on the last pipeline stage, per micro-batch), summed over all ranks and
logged in `on_validation_epoch_end`, which every rank runs.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from lightning_zeropp.core.step.chunked_loss import loss_chunk
from lightning_zeropp.metrics import CausalLMMetrics
from lightning_zeropp.models.gpt import GPT, GPTConfig
from lightning_zeropp.models.lr import warmup_cosine

__all__ = ["LitGPT", "warmup_cosine"]


class LitGPT(pl.LightningModule):
    """The bundled GPT as a LightningModule.

    Args:
        model: a `GPTConfig` (a fresh GPT is built from it), an already built `GPT`, or None
            for the default config.
        micro_batch_size: rows of one pipeline micro-batch (sets `example_input_array`).
        optimizer: "adamw" or "sgd"; `lr`, `weight_decay` go with it.
        warmup_steps, max_steps: linear warm-up then cosine decay to 10% (no schedule when
            `max_steps` is 0).
        ignore_index: target value left out of the loss and the metrics.
    """

    def __init__(
        self,
        model: GPTConfig | GPT | None = None,
        *,
        micro_batch_size: int = 1,
        optimizer: str = "adamw",
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        max_steps: int = 0,
        ignore_index: int = -100,
    ) -> None:
        super().__init__()
        if isinstance(model, GPT):
            self.cfg, self.model = model.cfg, model
        else:
            self.cfg = model or GPTConfig()
            self.model = GPT(self.cfg)
        self.example_input_array = torch.zeros(micro_batch_size, self.cfg.seq_len, dtype=torch.long)
        if optimizer not in ("adamw", "sgd"):  # checked here, on every rank, before any setup
            raise ValueError(f"optimizer={optimizer!r} is unknown; use one of ['adamw', 'sgd'].")
        self.optimizer_name, self.lr, self.weight_decay = optimizer, lr, weight_decay
        self.warmup_steps, self.max_steps = warmup_steps, max_steps
        self.ignore_index = ignore_index
        # No parameters, so ZeroPPStrategy still finds `model` as the one network to pipeline.
        self.val_metrics = CausalLMMetrics(
            self.cfg.vocab_size, ignore_index=ignore_index, prefix="val_"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self._loss_and_logits(batch)[0]

    def _loss_and_logits(
        self, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)  # (batch, time, vocab)
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(flat, y.reshape(-1), ignore_index=self.ignore_index), logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | dict[str, Any]:
        if type(self)._loss is not LitGPT._loss or not loss_chunk():
            loss = self._loss(batch)  # a subclass's own loss, or chunks turned off
            self.log("train_loss", loss, prog_bar=True, sync_dist=True)
            return loss
        # The head and the loss in chunks (`models.gpt.Head`): the logits never exist whole.
        # The loss is the mean over the labelled targets: returned with their count, so a
        # pipeline weighs its micro-batches by it (as it weighs a mean F.cross_entropy).
        x, y = batch
        extra = {} if self.ignore_index == -100 else {"ignore_index": self.ignore_index}
        loss = self.model(x, targets=y, **extra)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return {"loss": loss, "num_items": (y != self.ignore_index).sum()}

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if type(self)._loss is not LitGPT._loss:
            # A subclass with its own `_loss` keeps it for validation too (as before metrics
            # existed); its logits are not at hand, so the metrics stay empty.
            loss = self._loss(batch)
        else:
            loss, logits = self._loss_and_logits(batch)
            self.val_metrics.update(logits, batch[1])
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def on_validation_epoch_end(self) -> None:
        # Every rank runs this hook: compute() sums the metric states over all ranks (those
        # without the last stage hold zeros), so every rank logs the same values; sync_dist only
        # keeps Lightning from warning about unsynced epoch-level values.
        values = self.val_metrics.compute()
        self.val_metrics.reset()
        if not math.isnan(values["val_perplexity"]):  # nothing updated anywhere: nothing to log
            self.log_dict(values, sync_dist=True)

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
        return warmup_cosine(step, self.warmup_steps, self.max_steps)
