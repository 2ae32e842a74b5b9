"""An elastic job that loses a node: the script each torchrun worker runs (`elastic_cluster.py`).

Written as a user writes an elastic Lightning fit: the global batch is fixed (8 rows) and each
attempt derives its data-parallel width from the world torchrun gave it (`dp = world // pp_size`),
each data-parallel rank's rows (`8 // dp`) and the micro-batches (rows // 2: micro-batches of 2
rows, so a rank's memory stays as it was and its accumulation doubles when dp halves).
`ModelCheckpoint(save_last=True, every_n_train_steps=1)` saves every step; each attempt resumes
from `ckpt_path="last"`. On the first attempt, before step `kill_step`, the node named
`kill_host` dies as a lost machine does: its agent is SIGKILLed and its workers exit without
cleanup.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.core.hosts import this_host
from tests.distributed.common import make_model, make_optimizer

GLOBAL_ROWS = 8  # rows per optimizer step, whatever the world
MICRO_ROWS = 2  # rows per micro-batch
ROWS = 32  # 4 steps per epoch, 2 epochs


class ElasticLM(pl.LightningModule):
    def __init__(self, rows_per_rank: int) -> None:
        super().__init__()
        self.model = make_model(0)
        self.rows_per_rank = rows_per_rank

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer("adamw", self.parameters())

    def train_dataloader(self) -> DataLoader:
        from tests.distributed.resume_scenarios import TokenRows

        return DataLoader(TokenRows(ROWS), batch_size=self.rows_per_rank, shuffle=True)


class LoseNode(pl.Callback):
    """Before step `step`, every rank on host `host` dies; its first rank SIGKILLs its agent
    first (torchrun's workers run in sessions of their own, so they do not die with it)."""

    def __init__(self, step: int, host: str) -> None:
        self.step, self.host = step, host

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step - 1 and this_host() == self.host:
            if os.environ["LOCAL_RANK"] == "0":
                os.kill(os.getppid(), signal.SIGKILL)
            else:
                time.sleep(1.0)  # the agent dies first: it must not restart this node's ranks
            os._exit(1)


def shrink(
    out: str, pp_size: int, kill_step: int, kill_host: str = "nodeB", fixed_rows: int | None = None
) -> dict[str, Any]:
    """`fixed_rows`: the script a user writes without thinking of the restart, each rank's
    rows fixed (the global batch halves with the world): its resume must be refused."""
    # resume_scenarios reads WORLD_SIZE at import: a worker's module, not the test's
    from tests.distributed.resume_scenarios import Record, _full

    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    dp = max(world // pp_size, 1)  # a pipeline that does not fit is the strategy's to refuse
    rows = GLOBAL_ROWS // dp if fixed_rows is None else fixed_rows
    last = ModelCheckpoint(dirpath=Path(out), save_last=True, every_n_train_steps=1)
    record = Record()
    callbacks: list[pl.Callback] = [record, last]
    if attempt == "0":
        callbacks.append(LoseNode(kill_step, kill_host))
    strategy = ZeroPPStrategy(pp_size=pp_size, num_microbatches=rows // MICRO_ROWS)
    trainer = pl.Trainer(
        accelerator="cpu", devices=local, num_nodes=world // local, strategy=strategy,
        max_epochs=2, callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True,
    )  # fmt: skip
    module = ElasticLM(rows)
    trainer.fit(module, ckpt_path="last")
    engine = strategy.engine
    return {
        "attempt": attempt,
        "host": this_host(),
        "world": world,
        "dp": engine.config.dp_size,
        "num_microbatches": engine.config.num_microbatches,
        "steps": record.steps,
        "losses": record.losses,
        "rows": record.rows,
        "params": {n: _full(p) for n, p in module.model.named_parameters()},
    }
