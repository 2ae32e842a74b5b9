"""Lightning's training loader is checked at setup only where its `batch_size` is the rows a step
splits into micro-batches: torch's default collate and no batch-transfer hook. A pre-batched
dataset, a stacking collate or a hook that changes the rows is left to the engine's own check at
the step, which reads the batch itself (it was refused at setup by the loader's batch_size)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_zeropp.lightning.data import check_batch_size

DIMS: Any = SimpleNamespace(dp_size=2)


class _Plain(pl.LightningModule):
    pass


class _Stacking(pl.LightningModule):
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return torch.cat([batch, batch])  # two views of each row: 3 rows become 6


def _trainer(module: pl.LightningModule) -> Any:
    return SimpleNamespace(lightning_module=module, datamodule=None)


def test_a_loader_batch_the_micro_batches_do_not_divide_is_refused() -> None:
    loader = DataLoader(torch.zeros(12, 2), batch_size=3)
    with pytest.raises(ValueError, match=r"3 rows per batch .* num_microbatches=2"):
        check_batch_size(_trainer(_Plain()), loader, DIMS, 2)


def test_rows_the_loader_does_not_decide_are_left_to_the_step() -> None:
    pre_batched = DataLoader([torch.zeros(8, 2)], batch_size=1, collate_fn=lambda b: b[0])
    check_batch_size(_trainer(_Plain()), pre_batched, DIMS, 2)  # 8 rows a step
    stacked = DataLoader(torch.zeros(12, 2), batch_size=3)
    check_batch_size(_trainer(_Stacking()), stacked, DIMS, 2)  # 6 rows a step
