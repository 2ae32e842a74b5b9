"""A LightningModule holding a plain `AutoModelForCausalLM` (no library call), trained on padded
batches through `ZeroPPStrategy` and in one process."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

from lightning_zeropp.lightning import ZeroPPStrategy
from tests.distributed.clm_loop import Args, Texts, build_model, collate


class CausalLM(pl.LightningModule):
    """As an HF user writes one: the model's own loss, with the collator's mask and labels."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.model = build_model(Args(family=family))
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        outputs = self.model(
            batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        )
        self.log("train_loss", outputs.loss)
        return outputs.loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(self.trainer.callback_metrics["train_loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def run(family: str, strategy: dict[str, Any] | None, devices: int) -> dict[str, Any]:
    torch.manual_seed(0)
    loader = DataLoader(Texts(24, 1), batch_size=8, collate_fn=collate)  # 3 steps, same order
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=ZeroPPStrategy(**strategy) if strategy else "auto",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # dp_size is 1: every rank reads the loader in order, as the one process does (a
        # distributed sampler would shuffle the training data, as Lightning always does).
        use_distributed_sampler=False,
    )
    module = CausalLM(family)
    trainer.fit(module, loader)
    if strategy:
        params = trainer.strategy.full_state_dict()
    else:
        params = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    return {"losses": module.losses, "params": params}


class OwnLoss(CausalLM):
    """The same model with the loss written by hand, as many users write it: the logits, then
    cross-entropy over the real (unpadded) next tokens."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        targets = batch["labels"][:, 1:]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss


class SyncedCausalLM(CausalLM):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        outputs = self.model(**batch)
        self.log("train_loss", outputs.loss, sync_dist=True)
        return outputs.loss


DP_ROWS, DP_BATCH, DP_STEPS = 24, 8, 3


def data_parallel(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """pp 2 x dp_shard 2, 4 micro-batches of 1 row per data-parallel rank: each rank reads its
    half of every global batch of 8 padded rows (rows 8k + d, 8k + d + 2, ...)."""
    out = {}
    world = int(os.environ["WORLD_SIZE"])
    dp_rank = int(os.environ["RANK"]) % 2  # pp-major: ranks 0, 1 hold stage 0
    for case in cases:
        torch.manual_seed(0)
        module = (OwnLoss if case["loss"] == "own" else SyncedCausalLM)("llama")
        rows = Subset(Texts(DP_ROWS, 1), list(range(dp_rank, DP_ROWS, 2)))
        loader = DataLoader(rows, batch_size=DP_BATCH // 2, collate_fn=collate)
        strategy = ZeroPPStrategy(pp_size=2, dp_shard_size=2, num_microbatches=4)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            max_steps=DP_STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,  # each rank's rows are chosen above
        )
        trainer.fit(module, loader)
        out[case["loss"]] = {"losses": module.losses, "params": trainer.strategy.full_state_dict()}
    return out
