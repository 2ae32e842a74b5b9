"""LightningModules written as users write them, trained through the strategy on gloo ranks.

None of them sets `example_input_array` or knows about pipelines: a forward that post-processes the
network's output, LitGPT's own `GPT`, Lightning's demo Transformer, torchvision's ViT, a step that crops sequences to
a length that changes per batch, and validation loaders of another batch size with a short last
batch.
"""

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
from tests.distributed.common import GLOBAL_BATCH, MODEL, make_batches, make_model

_WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # read once: Lightning deletes it at teardown
LR = 0.5


class PostProcessed(pl.LightningModule):
    """`forward` turns the network's logits into log-probabilities; the step uses nll_loss."""

    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.model(x), dim=-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        crop = getattr(self, "crop", None)
        if crop:  # a length that changes per batch: 16, 8, 12, ...
            n = crop[batch_idx % len(crop)]
            x, y = x[:, :n], y[:, :n]
        loss = F.nll_loss(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.nll_loss(self(x).flatten(0, 1), y.flatten()), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class LitGPTModule(pl.LightningModule):
    """litgpt's own GPT, as a user would wrap it."""

    def __init__(self) -> None:
        super().__init__()
        from litgpt.config import Config
        from litgpt.model import GPT as LitGPTModel

        torch.manual_seed(0)
        self.model = LitGPTModel(litgpt_config(Config))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def litgpt_config(config_cls: Any) -> Any:
    return config_cls(
        block_size=MODEL.seq_len,
        n_layer=4,
        n_embd=32,
        n_head=2,
        vocab_size=MODEL.vocab_size,
        padded_vocab_size=MODEL.vocab_size,
    )


class Record(pl.Callback):
    def __init__(self) -> None:
        self.logged: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # The demo logs nothing: its step's returned loss is what the progress bar shows.
        metric = trainer.callback_metrics.get("train_loss", outputs["loss"])
        self.logged.append(float(metric))


class ViTClassifier(pl.LightningModule):
    """torchvision's VisionTransformer (its module tree, `tests.vision_models`), as a user trains
    an image classifier: cross-entropy on the logits."""

    def __init__(self) -> None:
        super().__init__()
        from tests.vision_models import small_vit

        torch.manual_seed(0)
        self.model = small_vit(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def vit_data(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (3x32x32) and labels (10 classes), `steps` global batches of them."""
    g = torch.Generator().manual_seed(1)
    n = steps * GLOBAL_BATCH
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def fit_cases(cases: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for case in cases:
        name, refused = case.pop("id"), case.pop("refused", False)
        if not refused:
            out[name] = _fit(**case)
            continue
        try:  # refused at setup on every rank, before any collective of the step
            _fit(**case)
            out[name] = {"error": None}
        except ValueError as err:
            out[name] = {"error": str(err)}
    return out


def _fit(
    module: str,
    strategy: Any,
    steps: int = 3,
    accumulate: int = 1,
    crop: list[int] | None = None,
    val_batch: int | None = None,
) -> dict[str, Any]:
    strategy = strategy if isinstance(strategy, str) else ZeroPPStrategy(**strategy)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=_WORLD,
        strategy=strategy,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        limit_val_batches=0 if val_batch is None else None,
        deterministic=True,
    )
    lit = _module(module)
    if crop:
        lit.crop = crop
    record = Record()
    trainer.callbacks.append(record)
    dp = _dp(trainer)
    if module == "vit":
        images = DataLoader(
            TensorDataset(*vit_data(steps * accumulate)), batch_size=GLOBAL_BATCH // dp
        )
        trainer.fit(lit, images)
    else:
        trainer.fit(lit, _loader(steps * accumulate, GLOBAL_BATCH // dp))
    out: dict[str, Any] = {"logged": record.logged}
    if val_batch is not None:  # 3 global batches of rows, another batch size, a short last one
        val = trainer.validate(lit, _loader(3, val_batch, drop_last=False), verbose=False)
        out["val_loss"] = val[0]["val_loss"]
    out["params"] = {n: _full(p) for n, p in lit.model.named_parameters()}
    return out


def _module(name: str) -> pl.LightningModule:
    if name == "post":
        lit = PostProcessed()
        lit.model.load_state_dict(make_model(0).state_dict())
        return lit
    if name == "litgpt":
        return LitGPTModule()
    if name == "vit":
        return ViTClassifier()
    if name == "demo":
        from lightning.pytorch.demos import LightningTransformer

        torch.manual_seed(0)
        lit = LightningTransformer(vocab_size=MODEL.vocab_size)
        lit.prepare_data = lambda: None  # it downloads WikiText-2; the data here is our own
        for m in lit.modules():  # dropout draws differ between layouts: off for exact numbers
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
            if isinstance(m, torch.nn.MultiheadAttention):  # attention dropout is a float
                m.dropout = 0.0
        return lit
    raise ValueError(name)


def _dp(trainer: pl.Trainer) -> int:
    strategy = trainer.strategy
    if isinstance(strategy, ZeroPPStrategy):
        cfg = strategy.zeropp_config.resolve(_WORLD)
        return cfg.dp_size
    return _WORLD


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def _loader(steps: int, batch: int, drop_last: bool = True) -> DataLoader:
    batches = make_batches(steps)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False, drop_last=drop_last)


class WithMetrics(PostProcessed):
    """Token accuracy as torchmetrics objects, logged as objects; predictions; a skipped batch."""

    def __init__(self, skip: int | None = None) -> None:
        super().__init__()
        from torchmetrics.classification import MulticlassAccuracy

        self.skip = skip
        self.train_acc = MulticlassAccuracy(num_classes=MODEL.vocab_size, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=MODEL.vocab_size, average="micro")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        logp = self(x)
        loss = F.nll_loss(logp.flatten(0, 1), y.flatten())
        self.train_acc(logp.argmax(-1).flatten(), y.flatten())
        self.log("train_acc", self.train_acc)
        self.log("train_loss", loss, sync_dist=True)
        return None if batch_idx == self.skip else loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_acc.update(self(x).argmax(-1).flatten(), y.flatten())
        self.log("val_acc", self.val_acc)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)


class Capture(pl.Callback):
    def __init__(self) -> None:
        self.acc: list[float] = []
        self.logged: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.acc.append(float(trainer.callback_metrics["train_acc"]))
        self.logged.append(float(trainer.callback_metrics["train_loss"]))


def metrics_case(layout: dict[str, Any], skip: int | None) -> dict[str, Any]:
    """Metric objects logged per step and per epoch, predict, a skipped batch, the summary and
    the printed layout."""
    import logging

    from lightning.pytorch.callbacks import ModelSummary

    class Summary(ModelSummary):
        total = 0

        def _summary(self, trainer, pl_module):  # what the printed table counts
            summary = super()._summary(trainer, pl_module)
            Summary.total = summary.total_parameters
            return summary

    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("lightning.pytorch").addHandler(Lines())
    capture = Capture()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=_WORLD,
        strategy=ZeroPPStrategy(**layout),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[capture, Summary()],
        num_sanity_val_steps=0,
        deterministic=True,
    )
    lit = WithMetrics(skip)
    lit.model.load_state_dict(make_model(0).state_dict())
    dp = _dp(trainer)
    trainer.fit(lit, _loader(3, GLOBAL_BATCH // dp))
    val = trainer.validate(lit, _loader(3, 5, drop_last=False), verbose=False)
    preds = trainer.predict(lit, _loader(1, 6, drop_last=False))
    return {
        "acc": capture.acc,
        "logged": capture.logged,
        "val_acc": val[0]["val_acc"],
        "preds": [p.clone() for p in preds],
        "params": {n: _full(p) for n, p in lit.model.named_parameters()},
        "summary_total": Summary.total,
        "layout": [line for line in lines if "ZeroPP layout" in line],
    }


class BadLoss(PostProcessed):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.nll_loss(self(x).flatten(0, 1), y.flatten(), reduction="none")


def bad_loss(layout: dict[str, Any]) -> dict[str, Any]:
    """A non-scalar loss, seen on the last stage only: what each rank raises."""
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=_WORLD,
        strategy=ZeroPPStrategy(**layout),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(BadLoss(), _loader(1, GLOBAL_BATCH // _dp(trainer)))
    except Exception as err:  # noqa: BLE001 - the test reads what each rank raised
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": ""}
