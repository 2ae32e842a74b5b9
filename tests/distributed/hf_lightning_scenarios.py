"""A LightningModule holding a plain `AutoModelForCausalLM` (no library call), trained on padded
batches through `ZeroPPStrategy` and in one process."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_zeropp.lightning import ZeroPPStrategy
from lightning_zeropp.models.hf import export_hf
from tests.distributed.clm_loop import Args, Texts, build_model, collate
from tests.distributed.clm_scenarios import copies_gap, tied_names


class CausalLM(pl.LightningModule):
    """As an HF user writes one: the model's own loss, with the collator's mask and labels."""

    def __init__(self, family: str, tie_word_embeddings: bool = False) -> None:
        super().__init__()
        self.model = build_model(Args(family=family, tie_word_embeddings=tie_word_embeddings))
        self.losses: list[float] = []
        self.tied = tied_names(self.model)  # the test's probe: tied copies after each step
        self.gaps: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        outputs = self.model(
            batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        )
        self.log("train_loss", outputs.loss)
        return outputs.loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(self.trainer.callback_metrics["train_loss"]))
        engine = getattr(self.trainer.strategy, "engine", None)
        if self.tied and engine is not None:
            self.gaps.append(copies_gap(self.tied, engine.module))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def run_cases(
    cases: list[dict[str, Any]], strategy: dict[str, Any] | None, devices: int
) -> dict[str, Any]:
    """Several models in one launch: each case {"id", "family", "tie_word_embeddings",
    "export_to"} (an HF export of the trained model, `models.hf.export_hf`)."""
    return {case["id"]: run(strategy=strategy, devices=devices, **case) for case in cases}


def run(
    family: str,
    strategy: dict[str, Any] | None,
    devices: int,
    tie_word_embeddings: bool = False,
    catch: bool = False,
    export_to: str | None = None,
    id: str = "",  # noqa: A002 - the case's name, ignored here
) -> dict[str, Any]:
    """4 steps of 8 padded rows; `catch`: report an error as {"error": ...} (the benchmark)."""
    if catch:
        try:
            return run(family, strategy, devices, tie_word_embeddings)
        except Exception as err:
            return {"error": f"{type(err).__name__}: {err}"}
    torch.manual_seed(0)
    loader = DataLoader(Texts(32, 1), batch_size=8, collate_fn=collate)  # 4 steps, same order
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=ZeroPPStrategy(**strategy) if strategy else "auto",
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # dp_size is 1: every rank reads the loader in order, as the one process does (a
        # distributed sampler would shuffle the training data, as Lightning always does).
        use_distributed_sampler=False,
    )
    module = CausalLM(family, tie_word_embeddings)
    trainer.fit(module, loader)
    if strategy:
        params = trainer.strategy.full_state_dict()
        if export_to is not None:
            export_hf(export_to, params, module.model.config)
    else:
        params = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    return {"losses": module.losses, "params": params, "gaps": module.gaps}
