"""A fit stopped by `max_steps` and saved after it resumes where it stopped: the checkpoint's loop
state, settled by `lightning.data.settle_stopped_epoch` (what `ZeroPPStrategy` saves), makes
Lightning continue the stopped epoch (mid-epoch) or start the next one at its first batch (at an
epoch's end). Lightning's own state after the stop counts the epoch completed: resumed under
`max_steps`, it went on in the next epoch with the stopped epoch's batch count, so the unseen
batches were never trained (mid-epoch), or the whole next epoch was taken as trained (at its end).
One process, Lightning's default strategy: the epoch and batch index of every resumed step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp.lightning.data import settle_stopped_epoch


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen: list[tuple[int, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append((self.current_epoch, batch_idx))
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2)  # epochs of 2 steps


def _trainer(max_steps: int, root: Path) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, default_root_dir=root,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's notes on a tiny run
@pytest.mark.parametrize(
    ("stop", "resumed"),
    [(1, [(0, 1), (1, 0), (1, 1)]), (2, [(1, 0), (1, 1)])],
    ids=["mid-epoch", "at-epoch-end"],
)
def test_a_fit_stopped_by_max_steps_resumes_where_it_stopped(
    tmp_path: Path, stop: int, resumed: list[tuple[int, int]]
) -> None:
    trainer = _trainer(stop, tmp_path)
    trainer.fit(_Tiny())
    path = tmp_path / "stopped.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    torch.save(settle_stopped_epoch(trainer, saved), path)
    module = _Tiny()
    _trainer(4, tmp_path).fit(module, ckpt_path=path)
    assert module.seen == resumed  # the uninterrupted run's steps stop+1 .. 4


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_save_in_the_end_hook_of_a_stopped_epoch_is_left_and_resumes_it(tmp_path: Path) -> None:
    # ModelCheckpoint's per-epoch save runs in on_train_epoch_end, also for the epoch a stop cut:
    # not yet counted completed there, and Lightning resumes it itself
    class Save(pl.Callback):
        def on_train_epoch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            saved = trainer._checkpoint_connector.dump_checkpoint()
            assert settle_stopped_epoch(trainer, saved) is saved
            torch.save(saved, tmp_path / "end.ckpt")

    trainer = _trainer(1, tmp_path)
    trainer.callbacks.append(Save())
    trainer.fit(_Tiny())
    module = _Tiny()
    _trainer(4, tmp_path).fit(module, ckpt_path=tmp_path / "end.ckpt")
    assert module.seen == [(0, 1), (1, 0), (1, 1)]


def test_a_save_inside_an_epoch_is_left_as_lightning_wrote_it(tmp_path: Path) -> None:
    class Save(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 1:
                self.saved = trainer._checkpoint_connector.dump_checkpoint()

    save = Save()
    trainer = _trainer(2, tmp_path)
    trainer.callbacks.append(save)
    trainer.fit(_Tiny())
    trainer.fit_loop.epoch_progress.current.processed = 0  # as it was at that step
    assert settle_stopped_epoch(trainer, save.saved) is save.saved
