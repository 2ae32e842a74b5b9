"""Resume scenarios on gloo ranks: runs stopped anywhere in an epoch continue with the next batch.

Written the way users write them (4 ranks, pp 2 x dp 2, 4 steps per epoch, 2 epochs):
- `lightning`: a plain LightningModule over a shuffled `DataLoader` (Lightning injects the
  DistributedSampler) and `ModelCheckpoint(every_n_train_steps=2)`; then fresh Trainers (from other initial weights) resumed with `ckpt_path=`
  from step 4 (saved at the epoch's last batch) and step 6 (mid-epoch 1, under `max_steps`);
- `elastic`: the same fit under `torchrun --max-restarts 1`, one rank killed mid-run, resumed from
  `ckpt_path="last"` by the restarted attempt;
- `accelerate`: a loop in the shape of transformers' `run_clm_no_trainer.py` under
  `ZeroPPAccelerator`: `save_state` every 2 updates into `step_<n>`, and a run resumed from
  `step_6` with `load_state`, run_clm's `resume_step` arithmetic and
  `accelerator.skip_first_batches(train_dataloader, resume_step)`. Its batches are padded to
  their longest row, so some micro-batches have no padding (and HF builds no mask for them).
Every run reports, per rank and step, the loss and the first token of each row it trained on.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

from lightning_zeropp import ZeroPPStrategy
from tests.distributed.common import MODEL, make_model

LAYOUT = {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 2}
ROWS = 32  # 2 data-parallel ranks x 4 rows x 4 steps per epoch
BATCH = 4  # rows per data-parallel rank and step
_WORLD_SIZE = int(os.environ["WORLD_SIZE"])  # Lightning's teardown deletes WORLD_SIZE


class TokenRows(Dataset):
    """(input, target) token rows; row i's first input token is i (to identify the rows)."""

    def __init__(self, rows: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, MODEL.vocab_size, (rows, MODEL.seq_len), generator=g)
        self.x[:, 0] = torch.arange(rows)
        self.y = torch.randint(0, MODEL.vocab_size, (rows, MODEL.seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class PlainLM(pl.LightningModule):
    def __init__(self, init_seed: int) -> None:
        super().__init__()
        self.model = make_model(init_seed)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenRows(ROWS), batch_size=BATCH, shuffle=True, drop_last=True)


class Record(pl.Callback):
    """Per step on this rank: the global step, the logged loss and the rows trained on."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.rows: list[list[int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(trainer.global_step)
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        self.rows.append(batch[0][:, 0].tolist())


def lightning(out: str) -> dict[str, Any]:
    root = Path(out)
    every_2 = ModelCheckpoint(
        dirpath=root / "steps", filename="{step}", every_n_train_steps=2, save_top_k=-1
    )
    runs = {"straight": fit(callbacks=[every_2])}
    for name, path, limit in [
        ("step4", "steps/step=4.ckpt", {}),  # saved at epoch 0's last batch: epoch 1 from its start
        ("step6", "steps/step=6.ckpt", {"max_steps": 8}),  # mid-epoch 1, in its sampler order
    ]:
        runs[name] = fit(resume_from=root / path, init_seed=7, **limit)
    return runs


class DieBefore(pl.Callback):
    """Global rank 1 dies (no cleanup, as a crashed process) before training step `step`."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step - 1 and trainer.global_rank == 1:
            os._exit(1)


def elastic(out: str) -> dict[str, Any]:
    """Run by `torchrun --max-restarts 1`: the first attempt dies before step 6; the restarted
    attempt resumes from `ckpt_path="last"` (ModelCheckpoint(save_last=True,
    every_n_train_steps=1)) and finishes. The same script, unchanged, runs both attempts."""
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    last = ModelCheckpoint(dirpath=Path(out), save_last=True, every_n_train_steps=1)
    callbacks: list[pl.Callback] = [last] + ([DieBefore(6)] if attempt == "0" else [])
    return fit(callbacks, resume_from="last") | {"attempt": attempt}


def fit(
    callbacks: list[pl.Callback] | None = None,
    resume_from: Path | str | None = None,
    init_seed: int = 0,
    max_steps: int = -1,
) -> dict[str, Any]:
    record = Record()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=_WORLD_SIZE,
        strategy=ZeroPPStrategy(**LAYOUT),
        max_epochs=2 if max_steps == -1 else None,
        max_steps=max_steps,
        callbacks=[record, *(callbacks or [])],
        logger=False,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    module = PlainLM(init_seed)
    start = time.perf_counter()
    trainer.fit(module, ckpt_path=resume_from)
    print(f"fit from {resume_from}: {time.perf_counter() - start:.1f}s", flush=True)
    params = {n: _full(p) for n, p in module.model.named_parameters()}
    return {"steps": record.steps, "losses": record.losses, "rows": record.rows, "params": params}


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


# ---------------------------------------------------------------------------------- Accelerate
def accelerate(out: str) -> dict[str, Any]:
    root = Path(out)
    runs = {"straight": run_clm(root, checkpointing_steps=2)}
    # From mid-epoch 1: run_clm's starting_epoch and resume_step arithmetic, then the skip.
    runs["step6"] = run_clm(root / "resumed", resume_from=root / "step_6")
    # The same state into a loop whose global batch is twice the saved one: refused at
    # load_state (run_clm's arithmetic would start at epoch 3 of 2 and train nothing).
    try:
        run_clm(root / "other", resume_from=root / "step_6", batch_size=4)
        runs["other_batch"] = None
    except ValueError as err:
        runs["other_batch"] = str(err)
    return runs


def run_clm(
    output_dir: Path,
    checkpointing_steps: int | None = None,
    resume_from: Path | None = None,
    batch_size: int = 2,
) -> dict[str, Any]:
    """run_clm_no_trainer.py's training loop (its lines, less tracking and evaluation), with the
    epoch set on the loader so that each epoch's order is reproducible after a restart."""
    from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
    from transformers import get_scheduler

    from lightning_zeropp.accelerate import ZeroPPAccelerator, ZeroPPPlugin
    from tests.distributed.clm_loop import Args, Texts, build_model, collate

    accelerator = ZeroPPAccelerator(
        zeropp_plugin=ZeroPPPlugin(pp_size=2, num_microbatches=2),
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=120))],
    )
    num_train_epochs, gradient_accumulation_steps = 2, 1
    model = build_model(Args(init_seed=7 if resume_from else 0))  # seeds torch with init_seed
    set_seed(0)  # run_clm's set_seed(args.seed): the sampler's seed, the same in every run
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    train_dataloader = DataLoader(
        Texts(32, 1), shuffle=True, collate_fn=collate, batch_size=batch_size
    )
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / gradient_accumulation_steps)
    max_train_steps = num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_scheduler(
        name="cosine",
        optimizer=optimizer,
        num_warmup_steps=accelerator.num_processes,
        num_training_steps=max_train_steps * accelerator.num_processes,
    )
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / gradient_accumulation_steps)
    max_train_steps = num_train_epochs * num_update_steps_per_epoch

    completed_steps, starting_epoch, resume_step = 0, 0, None
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        training_difference = os.path.splitext(os.path.basename(resume_from))[0]
        # need to multiply `gradient_accumulation_steps` to reflect real steps
        resume_step = int(training_difference.replace("step_", "")) * gradient_accumulation_steps
        starting_epoch = resume_step // len(train_dataloader)
        completed_steps = resume_step // gradient_accumulation_steps
        resume_step -= starting_epoch * len(train_dataloader)

    out: dict[str, Any] = {"steps": [], "losses": [], "rows": []}
    for epoch in range(starting_epoch, num_train_epochs):
        model.train()
        train_dataloader.set_epoch(epoch)
        if resume_from is not None and epoch == starting_epoch and resume_step is not None:
            # We skip the first `n` batches in the dataloader when resuming from a checkpoint
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                out["steps"].append(completed_steps)
                out["losses"].append(float(loss.detach()))
                out["rows"].append(batch["input_ids"][:, :4].tolist())
            if isinstance(checkpointing_steps, int):  # noqa: SIM102 - run_clm's own lines
                if completed_steps % checkpointing_steps == 0 and accelerator.sync_gradients:
                    accelerator.save_state(str(output_dir / f"step_{completed_steps}"))
            if completed_steps >= max_train_steps:
                break
    out["params"] = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    out["batches"] = model.stopper.batches  # SIGTERM's step numbers: counted on after a resume
    accelerator.free_memory()
    return out
