"""A fit stopped by `max_steps` and saved after it, or in the stopped epoch's end hook (where
`ModelCheckpoint` saves per epoch), resumes where it stopped: the checkpoint's loop state, settled
by `lightning.data.settle_stopped_epoch` (what `ZeroPPStrategy` saves), makes Lightning continue
the stopped epoch (cut short) or start the next one at its first batch (at an epoch's end).
Lightning's own state after the stop counts the epoch completed: resumed under `max_steps`, it
went on in the next epoch with the stopped epoch's batch count, so the unseen batches were never
trained (mid-epoch), or the whole next epoch was taken as trained (at its end); saved in the end
hook, it drew the rest of the epoch from the next epoch's permutation. One process, Lightning's
default strategy: the epoch and batch index, or the rows, of every resumed step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

from lightning_zeropp.lightning.data import ResumingLoader, settle_stopped_epoch


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


class _EpochSampler(Sampler[int]):
    """Shuffles by its epoch, as `DistributedSampler` does: a resume that draws the rest of an
    epoch from another permutation trains other rows."""

    def __init__(self, size: int) -> None:
        self.size, self.epoch = size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())


class _Shuffled(_Tiny):
    """Records the rows of each step; its loader is wrapped as `ZeroPPStrategy` wraps one."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.rows.append(batch[0][:, 0].int().tolist())
        return self.layer(batch[0]).sum()

    def train_dataloader(self) -> Any:
        rows = TensorDataset(torch.arange(8.0)[:, None].expand(8, 2))
        loader = DataLoader(rows, batch_size=2, sampler=_EpochSampler(8))  # epochs of 4 steps
        progress = self.trainer.fit_loop.epoch_loop.batch_progress
        return ResumingLoader(loader, lambda: progress.current.ready)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("stop", [1, 3, 4], ids=["cut-at-1", "cut-at-3", "at-epoch-end"])
def test_a_save_in_the_end_hook_of_an_ended_epoch_resumes_the_rows_it_left(
    tmp_path: Path, stop: int
) -> None:
    # ModelCheckpoint's per-epoch save runs in on_train_epoch_end, also for the epoch a stop cut:
    # processed there, not completed, and Lightning resumed it in the next epoch's permutation
    class Save(pl.Callback):
        def on_train_epoch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if not hasattr(self, "saved"):
                saved = trainer._checkpoint_connector.dump_checkpoint()
                self.saved = settle_stopped_epoch(trainer, saved)

    whole = _Shuffled()
    _trainer(8, tmp_path).fit(whole)
    save = Save()
    trainer = _trainer(stop, tmp_path)
    trainer.callbacks.append(save)
    trainer.fit(_Shuffled())
    torch.save(save.saved, tmp_path / "end.ckpt")
    resumed = _Shuffled()
    _trainer(8, tmp_path).fit(resumed, ckpt_path=tmp_path / "end.ckpt")
    assert resumed.rows == whole.rows[stop:]


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
