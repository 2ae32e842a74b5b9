"""A LightningModule for HF causal LMs, written as any LightningModule is.

Batches are `(input_ids, targets)` as the bundled `TokenDataset` yields them: `targets[:, t]` is
the token that follows `input_ids[:, t]` (already shifted). Both loss paths compute the same
number, the mean next-token cross-entropy over every position of the batch:

- `loss="labels"`: the model's own loss, `model(input_ids, labels=targets, shift_labels=targets)
  .loss`. HF's `labels=` convention is "aligned with input_ids, shifted inside the loss"; the
  targets here are already shifted, so they also go in as `shift_labels` (HF's argument for
  pre-shifted labels) and HF does not shift them again. `labels=` is what asks for a loss.
- `loss="logits"`: cross-entropy computed here from `model(input_ids).logits` and `targets`.

Under `ZeroPPStrategy` the step runs unchanged (the model's call adapter, attached by
`prepare_causal_lm`, keeps `labels` away from the first stage and gives the last stage's call an
HF-shaped output). `example_input_array` is one micro-batch of token ids, for the tracer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zeropp.models.hf import export_hf, prepare_causal_lm

__all__ = ["LitCausalLM"]

_OPTIMIZERS = ("adamw", "sgd")
_LOSSES = ("labels", "logits")


class LitCausalLM(pl.LightningModule):
    """Train an HF `*ForCausalLM` (from `models.hf.build_causal_lm` / `from_pretrained`).

    Args:
        model: the HF model; `prepare_causal_lm` is applied (idempotent).
        micro_batch_size: rows per pipeline micro-batch (per-rank batch / num_microbatches).
        seq_len: tokens per row (fixed: pipeline stages fix their shapes).
        lr, optimizer ("adamw" or "sgd"), weight_decay, eps (AdamW only).
        loss: "labels" (the model's own loss) or "logits" (cross-entropy here).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        micro_batch_size: int,
        seq_len: int,
        lr: float = 3e-4,
        optimizer: str = "adamw",
        loss: str = "labels",
        weight_decay: float = 0.0,
        eps: float = 1e-8,
    ) -> None:
        super().__init__()
        if optimizer not in _OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is unknown; use one of {list(_OPTIMIZERS)}.")
        if loss not in _LOSSES:
            raise ValueError(f"loss={loss!r} is unknown; use one of {list(_LOSSES)}.")
        for name, value in (("micro_batch_size", micro_batch_size), ("seq_len", seq_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int.")
        self.model = prepare_causal_lm(model)
        # Kept apart from the model: after setup `self.model` is this rank's pipeline stages.
        self.hf_config = model.config
        self.example_input_array = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
        self.optimizer_name, self.lr, self.loss_mode = optimizer, lr, loss
        self.weight_decay, self.eps = weight_decay, eps

    def forward(self, input_ids: torch.Tensor) -> Any:
        return self.model(input_ids)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        input_ids, targets = batch  # (batch, time) each; targets already shifted
        if self.loss_mode == "labels":
            return self.model(input_ids, labels=targets, shift_labels=targets).loss
        logits = self.model(input_ids).logits  # (batch, time, vocab)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(
            self.parameters(), lr=self.lr, eps=self.eps, weight_decay=self.weight_decay
        )

    def export_hf(self, path: str | Path) -> Path:
        """Collective: write the trained model as an HF directory (rank 0 writes).

        Call it on every rank after `trainer.fit`. Under `ZeroPPStrategy` the stages' shards are
        gathered first; in a single process the model's own state is written.
        """
        gather = getattr(self.trainer.strategy, "full_state_dict", None) if self._trainer else None
        if gather is not None:
            state = gather()
        else:
            state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        return export_hf(path, state, self.hf_config)
