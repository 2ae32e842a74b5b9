"""A LightningModule holding a plain `AutoModelForCausalLM` (no library call), trained on padded
batches through `ZeroPPStrategy` and in one process."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_zeropp.lightning import ZeroPPStrategy
from tests.distributed.clm_loop import Args, Texts, build_model, collate


class CausalLM(pl.LightningModule):
    """As an HF user writes one: the model's own loss, with the collator's mask and labels."""

    def __init__(self, family: str, lora: bool = False) -> None:
        super().__init__()
        self.model = build_model(Args(family=family, lora=lora))
        self.lora = lora
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
        if self.lora:  # every parameter given: the frozen ones must still get no state
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=0.5)


def run(
    family: str, strategy: dict[str, Any] | None, devices: int, lora: bool = False
) -> dict[str, Any]:
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
    module = CausalLM(family, lora)
    trainer.fit(module, loader)
    if strategy:
        params = trainer.strategy.full_state_dict()
    else:
        params = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    names = {p: n for n, p in module.named_parameters()}
    optimizer = trainer.optimizers[0]
    return {
        "losses": module.losses,
        "params": params,
        "with_state": sorted(names[p] for p, s in optimizer.state.items() if s),
        "frozen": sorted(n for p, n in names.items() if not p.requires_grad),
    }
