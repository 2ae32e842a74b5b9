"""A fit stopped by `max_steps` and saved after it, or in the stopped epoch's end hook (where
`ModelCheckpoint` saves per epoch), resumes where it stopped: the checkpoint's loop state, settled
by `lightning.stopped_epoch.settle_stopped_epoch` (what `ZeroPPStrategy` saves), makes Lightning
continue the stopped epoch (cut short) or start the next one at its first batch (at an epoch's
end). Lightning's own state after the stop counts the epoch completed: resumed under `max_steps`,
it went on in the next epoch with the stopped epoch's batch count, so the unseen batches were
never trained (mid-epoch), or the whole next epoch was taken as trained (at its end); saved in the
end hook, it drew the rest of the epoch from the next epoch's permutation. One process,
Lightning's default strategy: the epoch and batch index, or the rows, of every resumed step; and
the step the loggers get (against the uninterrupted fit's), also through `ZeroPPStrategy` at
world size 1 (its load writes an epoch start for Lightning's restart under `max_steps`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.loggers.logger import Logger
from torch.utils.data import DataLoader, Sampler, TensorDataset

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.lightning.data import ResumingLoader
from lightning_zeropp.lightning.stopped_epoch import restart_at_epoch_start, settle_stopped_epoch
from lightning_zeropp.models import GPTConfig
from lightning_zeropp.models.lit_gpt import LitGPT


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


# The step the loggers get (Lightning's `_batches_that_stepped`) and the rows they get, after a
# resume, against the uninterrupted fit. Epochs of 4 steps with a validation loop: after batch 2 of
# each epoch (`val_check_interval=2`, also its batch -1 when a restart begins there), or at the
# epoch's end. Lightning's restart counted the step of a settled stop at a validation check again.


class _Logged(_Tiny):
    """Logs its loss each step and a validation value; records each step's loggers' step."""

    def __init__(self, end_at: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.end_at = end_at  # (epoch, batch) where on_train_batch_start returns -1
        self.steps: list[tuple[int, int, int]] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if (self.current_epoch, batch_idx) == self.end_at else None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        stepped = self.trainer.fit_loop.epoch_loop._batches_that_stepped  # the loggers' step
        self.steps.append((self.current_epoch, batch_idx, stepped))
        loss = self.layer(batch[0]).sum()
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val", self.layer(batch[0]).sum())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.ones(8, 2)), batch_size=2)  # epochs of 4 steps

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.ones(2, 2)), batch_size=2)


class _Rows(Logger):
    """The (step, names) of every row the loggers are given."""

    name, version = "rows", 0

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, list[str]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, sorted(metrics)))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


def _logged_fit(limit: dict[str, int], settings: dict[str, Any], stop_after: int = 0) -> pl.Trainer:
    class Stop(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            trainer.should_stop = trainer.fit_loop.total_batch_idx + 1 == stop_after

    return pl.Trainer(
        accelerator="cpu", devices=1, logger=_Rows(), log_every_n_steps=1, callbacks=[Stop()],
        num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **limit, **settings,
    )  # fmt: skip


_VAL2, _EPOCH_END = {"val_check_interval": 2}, {"val_check_interval": 1.0}
_ACC2 = {**_VAL2, "accumulate_grad_batches": 2}
_LOGGED_CASES: dict[str, tuple[dict[str, int], dict[str, int], dict[str, Any], Any, int]] = {
    # the stopped fit's limit, the resumed (and the uninterrupted) fit's, the trainers' settings,
    # the (epoch, batch) that returns -1, the batch (of all) after which should_stop is set
    "mid-epoch-at-a-val-check": ({"max_steps": 2}, {"max_steps": 8}, _VAL2, None, 0),
    "mid-epoch-no-val-check": ({"max_steps": 3}, {"max_steps": 8}, _VAL2, None, 0),
    "epoch-end-max-steps": ({"max_steps": 4}, {"max_steps": 8}, _EPOCH_END, None, 0),
    "epoch-end-max-epochs": ({"max_epochs": 1}, {"max_epochs": 2}, _VAL2, None, 0),
    "ended-by-user-max-steps": ({"max_epochs": 1}, {"max_steps": 6}, _VAL2, (0, 1), 0),
    "ended-by-user-max-epochs": ({"max_epochs": 1}, {"max_epochs": 2}, _VAL2, (0, 1), 0),
    "should-stop-inside-an-accumulation": ({"max_epochs": 2}, {"max_epochs": 2}, _ACC2, None, 3),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", list(_LOGGED_CASES))
def test_a_resumed_fit_logs_at_the_uninterrupted_fits_steps(tmp_path: Path, case: str) -> None:
    stop, limit, settings, end_at, stop_after = _LOGGED_CASES[case]
    whole = _Logged(end_at)
    whole_fit = _logged_fit(limit, settings)
    whole_fit.fit(whole)
    first = _Logged(end_at)
    stopped = _logged_fit(stop, settings, stop_after)
    stopped.fit(first)
    path = tmp_path / "stopped.ckpt"
    settled = settle_stopped_epoch(stopped, stopped._checkpoint_connector.dump_checkpoint())
    resumed, trainer = _Logged(end_at), _logged_fit(limit, settings)
    torch.save(restart_at_epoch_start(trainer, settled), path)  # as ZeroPPStrategy loads it
    trainer.fit(resumed, ckpt_path=path)
    assert resumed.steps == whole.steps[len(first.steps) :]
    rows = whole_fit.logger.rows  # type: ignore[union-attr]
    if not stop_after:  # (should_stop also runs the validation, which the whole fit did not)
        assert trainer.logger.rows == rows[len(stopped.logger.rows) :]  # type: ignore[union-attr]
    if end_at is not None:  # the epoch the user ended stays ended: the next one is trained whole
        assert [batch for epoch, batch, _ in resumed.steps if epoch == 1] == [0, 1, 2, 3]


_GPT_MODEL = GPTConfig(vocab_size=16, seq_len=8, dim=16, num_heads=2, num_layers=2)


class _SteppedGPT(LitGPT):
    """The bundled LitGPT (it validates), recording each step's loggers' step."""

    def __init__(self) -> None:
        super().__init__(_GPT_MODEL)
        self.steps: list[tuple[int, int, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        stepped = self.trainer.fit_loop.epoch_loop._batches_that_stepped
        self.steps.append((self.current_epoch, batch_idx, stepped))
        return super().training_step(batch, batch_idx)


def _zeropp_fit(
    module: LitGPT, max_steps: int, ckpt_path: Path | None = None, save_to: Path | None = None
) -> None:
    environ = dict(os.environ)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=ZeroPPStrategy(), max_steps=max_steps,
        logger=False, num_sanity_val_steps=0, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    x = torch.zeros(8, _GPT_MODEL.seq_len, dtype=torch.long)
    loader = DataLoader(TensorDataset(x, x), batch_size=4)  # epochs of 2 steps
    try:
        trainer.fit(module, loader, loader, ckpt_path=ckpt_path)
        if save_to is not None:
            trainer.save_checkpoint(save_to)
    finally:  # Lightning leaves its one-rank group and MASTER_PORT behind
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_zeropp_strategy_resumes_a_stop_at_an_epoch_end_at_its_logger_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The strategy settles the save and, loading it under max_steps, writes the epoch start for
    # Lightning's restart; with the epoch's validation at its batch -1 the step came one too high
    monkeypatch.chdir(tmp_path)  # Lightning's default_root_dir
    whole, first, resumed = _SteppedGPT(), _SteppedGPT(), _SteppedGPT()
    _zeropp_fit(whole, max_steps=4)
    _zeropp_fit(first, max_steps=2, save_to=tmp_path / "stopped")
    _zeropp_fit(resumed, max_steps=4, ckpt_path=tmp_path / "stopped")
    assert resumed.steps == whole.steps[2:] == [(1, 0, 2), (1, 1, 3)]
