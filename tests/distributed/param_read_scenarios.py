"""Parameters read outside the step, and checkpointing at the call site, as users write them.

A LightningModule whose own forward is the network and holds a CLIP-like scalar `logit_scale`,
and one wrapping the bundled GPT as `self.model`: both read parameters in `on_train_batch_end`
(the value, a weight norm for logging) and after `trainer.fit`, on every rank. A rank reads a
parameter its stages hold; any other read raises naming `lightning_zeropp.full_parameter`,
which (like `param_norm`) serves every rank the trained value. None sets `example_input_array`.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import lightning_zeropp
from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.models import GPT
from lightning_zeropp.models.gpt import Block
from tests.distributed.common import GLOBAL_BATCH, MODEL, make_batches

_WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # read once: Lightning deletes it at teardown
LR = 0.5


def _attempt(read: Any) -> tuple[float | None, str | None]:
    """What a read gives: its value, or the message of what it raised."""
    try:
        value = read()
        value = value.full_tensor() if isinstance(value, DTensor) else value
        return float(value), None
    except Exception as err:  # noqa: BLE001 - the test reads what each rank raised
        return None, f"{type(err).__name__}: {err}"


class Scaled(pl.LightningModule):
    """The module is the network: embedding, blocks, head and a learned `logit_scale`."""

    def __init__(self, call_site_checkpoint: bool | str = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_emb = nn.Embedding(MODEL.vocab_size, MODEL.dim)
        self.blocks = nn.ModuleList(Block(MODEL) for _ in range(4))
        self.head = nn.Linear(MODEL.dim, MODEL.vocab_size, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(0.0))  # CLIP's: no dimension
        self.call_site_checkpoint = call_site_checkpoint
        self.seen: list[dict[str, Any]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_emb(x)
        for block in self.blocks:
            if self.call_site_checkpoint:  # as users checkpoint: at the call, in the loop
                reentrant = self.call_site_checkpoint == "reentrant"
                h = checkpoint(block, h, use_reentrant=reentrant)
            else:
                h = block(h)
        return self.head(h) * self.logit_scale.exp()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        seen = {
            "direct": _attempt(lambda: self.logit_scale),
            "head_norm": _attempt(lambda: self.head.weight.norm()),
        }
        full = getattr(lightning_zeropp, "full_parameter", None)
        if full is not None:
            seen["full"] = float(full(self, "logit_scale"))
            norms = lightning_zeropp.param_norm(self)
            seen["norm"] = float(norms["param_2.0_norm/head.weight"])
        self.seen.append(seen)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class Wrapped(pl.LightningModule):
    """The bundled GPT as `self.model`; a hook logs its head's weight norm."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(MODEL)
        self.seen: list[dict[str, Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        seen = {
            "head_norm": _attempt(lambda: self.model.head.weight.norm()),
            "emb_norm": _attempt(lambda: self.model.tok_emb.weight.norm()),
        }
        if hasattr(lightning_zeropp, "param_norm"):
            norms = lightning_zeropp.param_norm(self)
            seen["norm"] = float(norms["param_2.0_norm/model.head.weight"])
            seen["total"] = float(norms["param_2.0_norm_total"])
        self.seen.append(seen)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _loader(steps: int, batch: int) -> torch.utils.data.DataLoader:
    batches = make_batches(steps)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False, drop_last=True)


def _trainer(layout: dict[str, Any], steps: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=_WORLD,
        strategy=ZeroPPStrategy(**layout),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )


def reads(layout: dict[str, Any], steps: int = 3) -> dict[str, Any]:
    """Both modules trained `steps` steps; what each read gave during and after fit."""
    out: dict[str, Any] = {}
    for name, cls in (("scaled", Scaled), ("wrapped", Wrapped)):
        lit = cls()
        trainer = _trainer(layout, steps)
        dp = trainer.strategy.zeropp_config.resolve(_WORLD).dp_size
        trainer.fit(lit, _loader(steps, GLOBAL_BATCH // dp))
        after: dict[str, Any] = {"seen": lit.seen}
        if name == "scaled":
            after["direct"] = _attempt(lambda lit=lit: lit.logit_scale)
            after["state_dict_has_scale"] = "logit_scale" in lit.state_dict()
            if hasattr(lightning_zeropp, "full_parameter"):
                after["full"] = float(lightning_zeropp.full_parameter(lit, "logit_scale"))
        else:
            after["head_norm"] = _attempt(lambda lit=lit: lit.model.head.weight.norm())
            if hasattr(lightning_zeropp, "full_parameter"):
                full = lightning_zeropp.full_parameter(lit, "model.head.weight")
                after["head"] = full.clone()
                try:
                    lightning_zeropp.full_parameter(lit, "model.heads.weight")
                except ValueError as err:
                    after["unknown"] = str(err)
        out[name] = after
    return out


def call_site_checkpoint(layout: dict[str, Any], steps: int = 3) -> dict[str, Any]:
    """`checkpoint(block, h, use_reentrant=False)` in forward: the losses and the trained state
    (rank 0), under GPipe (every micro-batch's forward runs before the first backward, so a
    recomputed block must find its own micro-batch's activations); then `use_reentrant=True`:
    what each rank raises."""
    trainer = _trainer({**layout, "schedule": "gpipe"}, steps)
    dp = trainer.strategy.zeropp_config.resolve(_WORLD).dp_size
    lit = Scaled(call_site_checkpoint=True)
    losses = _Losses()
    trainer.callbacks.append(losses)
    trainer.fit(lit, _loader(steps, GLOBAL_BATCH // dp))
    out: dict[str, Any] = {"losses": losses.logged, "state": trainer.strategy.full_state_dict()}
    trainer = _trainer(layout, 1)
    lit = Scaled(call_site_checkpoint="reentrant")
    try:
        trainer.fit(lit, _loader(1, GLOBAL_BATCH // dp))
        out["reentrant"] = None
    except Exception as err:  # noqa: BLE001 - the test reads what each rank raised
        out["reentrant"] = f"{type(err).__name__}: {err}"
    return out


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.logged: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.logged.append(float(trainer.callback_metrics["train_loss"]))


class ReadsScale(Scaled):
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.log("scale", float(self.logit_scale))  # held by the last stage only


def uncaught_read(layout: dict[str, Any]) -> dict[str, Any]:
    """A hook reading a parameter its rank does not hold, uncaught: what each rank raises."""
    import datetime

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=_WORLD,
        strategy=ZeroPPStrategy(**layout, timeout=datetime.timedelta(seconds=60)),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    dp = trainer.strategy.zeropp_config.resolve(_WORLD).dp_size
    try:
        trainer.fit(ReadsScale(), _loader(3, GLOBAL_BATCH // dp))
    except Exception as err:  # noqa: BLE001 - the test reads what each rank raised
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": ""}


def cases(layout: dict[str, Any]) -> dict[str, Any]:
    """The tested cases, in one launch (`uncaught_read` is run by hand: after a failure the
    process group is not reusable, so it would need a launch of its own)."""
    return {"reads": reads(layout), "checkpoint": call_site_checkpoint(layout)}
