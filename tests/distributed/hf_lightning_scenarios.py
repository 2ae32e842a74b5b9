"""A LightningModule holding a plain `AutoModelForCausalLM` (no library call), trained on padded
batches through `ZeroPPStrategy` and in one process."""

from __future__ import annotations

import functools
import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

from lightning_zeropp.lightning import ZeroPPStrategy
from lightning_zeropp.models.hf import export_hf
from tests.distributed.clm_loop import Args, Texts, build_model, collate
from tests.distributed.clm_scenarios import copies_gap, tied_names


class CausalLM(pl.LightningModule):
    """As an HF user writes one: the model's own loss, with the collator's mask and labels."""

    def __init__(self, family: str, tie_word_embeddings: bool = False, lora: bool = False) -> None:
        super().__init__()
        self.model = build_model(
            Args(family=family, tie_word_embeddings=tie_word_embeddings, lora=lora)
        )
        self.lora = lora
        self.losses: list[float] = []
        self.tied = tied_names(self.model)  # the test's probe: tied copies after each step
        self.gaps: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        outputs = self.model(
            batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        )
        self.log("train_loss", outputs.loss)
        return outputs.loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        outputs = self.model(
            batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        )
        self.log("val_loss", outputs.loss, batch_size=batch["input_ids"].shape[0])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(self.trainer.callback_metrics["train_loss"]))
        engine = getattr(self.trainer.strategy, "engine", None)
        if self.tied and engine is not None:
            self.gaps.append(copies_gap(self.tied, engine.module))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.lora:  # every parameter given: the frozen ones must still get no state
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
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
    lora: bool = False,
    validate: bool = False,
    pad_to_multiple_of: int = 1,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """4 steps of 8 padded rows (lengths rounded up to `pad_to_multiple_of`); `catch`: report an error as {"error": ...} (the benchmark);
    `validate`: then `trainer.validate` on 2 batches of 8 other rows (`val_loss`, the model's
    own loss logged by `validation_step`); `settings`: the case's own over the strategy's."""
    if strategy and settings:
        strategy = {**strategy, **settings}
    if catch:
        try:
            return run(family, strategy, devices, tie_word_embeddings, lora=lora)
        except Exception as err:
            return {"error": f"{type(err).__name__}: {err}"}
    torch.manual_seed(0)
    padded = functools.partial(collate, multiple=pad_to_multiple_of)
    loader = DataLoader(Texts(32, 1), batch_size=8, collate_fn=padded)  # 4 steps, same order
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
    module = CausalLM(family, tie_word_embeddings, lora)
    trainer.fit(module, loader)
    val_loss = None
    if validate:
        rows = DataLoader(Texts(16, 2), batch_size=8, collate_fn=padded)
        val_loss = trainer.validate(module, rows, verbose=False)[0]["val_loss"]
    if strategy:
        params = trainer.strategy.full_state_dict()
        if export_to is not None:
            export_hf(export_to, params, module.model.config)
    else:
        params = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    names = {p: n for n, p in module.named_parameters()}
    optimizer = trainer.optimizers[0]
    return {
        "losses": module.losses,
        "params": params,
        "with_state": sorted(names[p] for p, s in optimizer.state.items() if s),
        "frozen": sorted(n for p, n in names.items() if not p.requires_grad),
        "gaps": module.gaps,
        "val_loss": val_loss,
    }


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
