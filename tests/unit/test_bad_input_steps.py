"""A Lightning step whose result the pipeline cannot train on fails naming what it returned.

These checks run where the user's step becomes the loss function: on the last pipeline stage,
once per micro-batch. With more ranks, the failure board turns the last stage's error into a
PeerFailedError naming it on the other stages (tests/distributed/test_user_modules.py, the
non-scalar loss); here one process with one stage shows each message.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.models import GPTConfig
from lightning_zeropp.models.lit_gpt import LitGPT

MODEL = GPTConfig(vocab_size=16, seq_len=8, dim=16, num_heads=2, num_layers=2)


@pytest.fixture(autouse=True)
def one_process() -> Iterator[None]:
    """Lightning sets MASTER_PORT and friends and leaves its one-rank group behind: undo both."""
    environ = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


def _fit(module: pl.LightningModule) -> None:
    x = torch.zeros(8, MODEL.seq_len, dtype=torch.long)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ZeroPPStrategy(),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(x, x), batch_size=4))


class DictWithoutLoss(LitGPT):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return {"train_loss": self._loss(batch)}


class DetachedLoss(LitGPT):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self._loss(batch).detach()


class PerTokenLoss(LitGPT):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x)
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none")


class FloatLoss(LitGPT):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self._loss(batch)  # the network is called, but a Python number comes back (loss.item())
        return 1.5


class CallsTheNetworkTwice(LitGPT):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self._loss(batch) + self._loss(batch)


CASES = [
    (DictWithoutLoss, r"training_step returned a dict without 'loss' \(keys \['train_loss'\]\)"),
    (DetachedLoss, r"training_step returned a tensor that does not require grad as its loss"),
    (
        PerTokenLoss,
        r"training_step returned a tensor of shape \(4, 8\) as its loss; return a scalar",
    ),
    (FloatLoss, r"training_step returned 1.5 \(float\) as its loss; return a scalar tensor"),
    (
        CallsTheNetworkTwice,
        r"the step called the network \(self.model\(...\)\) more than once for one micro-batch",
    ),
]


@pytest.mark.parametrize(("cls", "match"), CASES, ids=[cls.__name__ for cls, _ in CASES])
def test_a_step_result_the_pipeline_cannot_train_on_is_named(cls, match):
    with pytest.raises(ValueError, match=match):
        _fit(cls(MODEL))
