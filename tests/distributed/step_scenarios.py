"""LightningModules written as users write them, with steps that do more than call the network.

- `FlatGPT`: nanoGPT's shape, every layer an attribute of the LightningModule (no `self.model`), a
  learned position table held as a bare `nn.Parameter`, the head tied to the embedding; its step
  masks tokens at random before the network and averages the loss over the masked tokens.
- `EncoderHead`: an encoder and a head, a position table and a CLIP-like `logit_scale` held by the
  module itself, and `example_input_array` set (it used to make such modules train).
- `Counting`: a plain `self.model`; the step counts tokens (an attribute and a `reduce_fx="sum"`
  log), skips batch 1 by returning None before the network, returns extra keys; the module logs
  `grad_norm` in `on_before_optimizer_step`; AdamW with two parameter groups under
  `LearningRateMonitor`, and a `ThroughputMonitor`.
- `DrawingFlatGPT`: `FlatGPT` seeded once, whose head draws from the generator (as dropout does):
  its step's random mask must be the same on the first stage and on the last.
- `CollatedFlatGPT`: the same, its mask drawn by the loader's `collate_fn` instead of its step:
  every stage must step on the first stage's batch.
The test (`test_lightning_steps.py`) trains each the way one process would and compares.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor, ThroughputMonitor
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset, default_collate

import lightning_zeropp
from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.models import GPT, GPTConfig
from lightning_zeropp.models.gpt import Block
from tests.distributed.common import GLOBAL_BATCH, make_batches

_WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # read once: Lightning deletes it at teardown
CFG = GPTConfig(vocab_size=64, seq_len=16, dim=32, num_heads=2, num_layers=4)
MASK_ID = 0
STEP_SEED = 123  # + the batch index: every rank seeds it before each batch (the reference too)
LR = 0.5


def masked(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hide about half the tokens; predict the targets at the hidden positions only."""
    hide = torch.rand(x.shape) < 0.5
    return torch.where(hide, MASK_ID, x), torch.where(hide, y, -100)


class Seeded(pl.LightningModule):
    """Seeds every rank's generator alike before each batch, as a user's seed_everything does
    before training (here per batch: Lightning draws from it between batches, for the loader's
    workers' seeds)."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        torch.manual_seed(STEP_SEED + batch_idx)


class FlatGPT(Seeded):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_emb = nn.Embedding(CFG.vocab_size, CFG.dim)
        self.pos_emb = nn.Parameter(torch.randn(CFG.seq_len, CFG.dim) * 0.1)
        self.blocks = nn.ModuleList(Block(CFG) for _ in range(CFG.num_layers))
        self.ln_f = nn.LayerNorm(CFG.dim)
        self.head = nn.Linear(CFG.dim, CFG.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # nanoGPT ties them

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = masked(*batch)
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class DrawingHead(nn.Linear):
    """A head that draws from the random generator without changing its output (as dropout
    draws its mask): only the stage holding it draws (other stages see it on the meta device),
    so without the strategy's random-state sync the stages' generators part."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.rand_like(x[..., :1])  # on the stage's device: dropout's draw
        return super().forward(x)


class DrawingFlatGPT(FlatGPT):
    """`FlatGPT` seeded once (at construction, as `seed_everything` before `fit`), not before
    every batch, with a head that draws: the mask its step draws before the network must be the
    one the first stage reads (inputs) and the one the loss reads (targets, last stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = DrawingHead(CFG.dim, CFG.vocab_size, bias=False)
        self.masks: list[torch.Tensor] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        pass  # seeded once, in __init__

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = masked(*batch)
        self.masks.append((y != -100).clone())  # this micro-batch's mask, on every stage
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss


def masked_collate(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A collate_fn that draws (a random augmentation in the loader): `masked` rows."""
    return masked(*default_collate(rows))


class CollatedFlatGPT(DrawingFlatGPT):
    """`DrawingFlatGPT` whose mask is drawn by the loader's `collate_fn` (`masked_collate`), on
    every rank from its own generator: every stage must step on the first stage's batch."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.masks.append(torch.stack([y != -100, x == MASK_ID]))  # on every stage
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(CFG.vocab_size, CFG.dim)
        self.blocks = nn.ModuleList(Block(CFG) for _ in range(CFG.num_layers))

    def forward(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return x


class EncoderHead(Seeded):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = Encoder()
        self.head = nn.Linear(CFG.dim, CFG.vocab_size)
        self.pos = nn.Parameter(torch.randn(CFG.seq_len, CFG.dim) * 0.1)
        self.logit_scale = nn.Parameter(torch.tensor(0.0))  # CLIP's: no dimension
        self.example_input_array = torch.zeros(2, CFG.seq_len, dtype=torch.long)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(idx, self.pos)) * self.logit_scale.exp()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class Counting(Seeded):
    SKIP = 1

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(CFG)
        self.tokens = 0
        self.norms: list[float] = []
        self.extras: list[tuple[str, ...]] = []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor] | None:
        x, y = batch
        if batch_idx == self.SKIP:
            return None
        self.tokens += x.numel()
        self.log("tokens", float(x.numel()), reduce_fx="sum", sync_dist=True)
        logits = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return {"loss": loss, "predicted": logits.argmax(-1)}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if "predicted" in outputs:  # a skipped batch returns the loss only
            shape = tuple(outputs["predicted"].shape)
            self.extras.append((*sorted(outputs), *map(str, shape)))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        norms = lightning_zeropp.grad_norm(self, norm_type=2)
        if norms:  # none in a skipped batch
            self.norms.append(float(norms["grad_2.0_norm_total"]))
            self.log_dict(norms)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=1e-3, eps=1e-6)


class Memory(Logger):
    """Every metric every logger call got, on rank 0."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append({k: float(v) for k, v in metrics.items()})

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.logged: list[float] = []
        self.tokens: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.logged.append(float(trainer.callback_metrics.get("train_loss", float("nan"))))
        self.tokens.append(float(trainer.callback_metrics.get("tokens", float("nan"))))


MODULES = {
    "flat": FlatGPT,
    "encoder_head": EncoderHead,
    "counting": Counting,
    "drawing": DrawingFlatGPT,
    "collating": CollatedFlatGPT,
}


def fit_cases(cases: list[dict[str, Any]]) -> dict[str, Any]:
    return {case.pop("id"): _fit(**case) for case in cases}


def _fit(module: str, layout: dict[str, Any], steps: int = 3) -> dict[str, Any]:
    lit = MODULES[module]()
    losses, memory = Losses(), Memory()
    callbacks: list[pl.Callback] = [losses]
    if module == "counting":
        callbacks += [
            LearningRateMonitor(),
            ThroughputMonitor(batch_size_fn=lambda b: len(b[0]), window_size=2),
        ]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=_WORLD,
        strategy=ZeroPPStrategy(**layout),
        max_steps=steps,
        logger=memory,
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    dp = trainer.strategy.zeropp_config.resolve(_WORLD).dp_size
    collate = masked_collate if module == "collating" else None
    trainer.fit(lit, _loader(steps, GLOBAL_BATCH // dp, collate))
    out: dict[str, Any] = {
        "logged": losses.logged,
        "params": {n: _full(p) for n, p in lit.named_parameters()},
        "metrics": memory.metrics,
    }
    if module == "counting":
        out |= {"tokens": lit.tokens, "logged_tokens": losses.tokens, "norms": lit.norms}
        out["extras"] = lit.extras
    if module in ("drawing", "collating"):
        out["masks"] = lit.masks
    return out


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def _loader(steps: int, batch: int, collate: Any = None) -> DataLoader:
    batches = make_batches(steps)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    return DataLoader(TensorDataset(x, y), batch_size=batch, drop_last=True, collate_fn=collate)
