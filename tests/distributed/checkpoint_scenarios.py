"""Checkpoint scenarios on gloo ranks: full files, sharded directories, resuming from a file.

One launch runs every fit the checkpoint tests compare (pp 2 x dp_shard 2, `split="stack"`,
AdamW, 3 steps per epoch):
- `sharded`: 2 epochs straight; `ModelCheckpoint` writes a sharded directory per epoch, in the
  background (`async_save=True`: the next epoch trains while it is written), and
  `trainer.save_checkpoint` after fit (complete when it returns: nothing else would wait for it);
- `full`: 1 epoch with `state_dict_type="full"`; `ModelCheckpoint` and `trainer.save_checkpoint`
  each write one file;
- `resumed`: epoch 2 resumed (default strategy) from `full`'s file, from other initial weights;
- `resumed_consolidated`: the same from `sharded`'s first directory consolidated into one file by
  Lightning's own consolidation code (what its `consolidate_checkpoint` command runs).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.load import _load_distributed_checkpoint
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint
from torch.utils.data import DataLoader

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.models.lit_gpt import LitGPT
from tests.distributed.common import GLOBAL_BATCH, MODEL, make_model
from tests.distributed.lightning_scenarios import Record, _full, _loader, _world_size

LAYOUT = {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 2}
STEPS_PER_EPOCH = 3
MICRO_BATCH = GLOBAL_BATCH // 2 // 2  # global batch / dp / micro-batches


def run_all(out: str) -> dict[str, Any]:
    root = Path(out)
    sharded = fit(
        2,
        checkpoint_dir=root / "sharded",
        save_to=root / "after-fit.ckpt",
        async_save=True,
        every_two=root / "every2",
    )
    full = fit(
        1, state_dict_type="full", checkpoint_dir=root / "full", save_to=root / "explicit.ckpt"
    )
    resumed = fit(2, resume_from=root / "full" / "epoch=0.ckpt", init_seed=7)
    consolidated = root / "consolidated-epoch0.ckpt"
    if dist.get_rank() == 0:
        checkpoint = _load_distributed_checkpoint(root / "sharded" / "epoch=0.ckpt")
        torch.save(_format_checkpoint(checkpoint), consolidated)
    dist.barrier()
    resumed_consolidated = fit(2, resume_from=consolidated, init_seed=7)
    fit(1, save_to=root / "step2.ckpt", max_steps=2)  # mid-epoch: 2 of the epoch's 3 batches
    try:  # resumed with twice the global batch it was saved with
        fit(2, resume_from=root / "step2.ckpt", init_seed=7, batch_scale=2)
        other_batch = "resumed"
    except ValueError as err:
        other_batch = str(err)
    return {
        "sharded": sharded,
        "full": full,
        "resumed": resumed,
        "resumed_consolidated": resumed_consolidated,
        "other_batch": other_batch,
    }


def fit(
    epochs: int,
    state_dict_type: str = "sharded",
    checkpoint_dir: Path | None = None,
    save_to: Path | None = None,
    resume_from: Path | None = None,
    init_seed: int = 0,
    async_save: bool = False,
    every_two: Path | None = None,
    max_steps: int = -1,
    batch_scale: int = 1,
) -> dict[str, Any]:
    strategy = ZeroPPStrategy(
        split="stack", state_dict_type=state_dict_type, async_save=async_save, **LAYOUT
    )
    record = Record()
    callbacks: list[pl.Callback] = [record]
    if checkpoint_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, filename="{epoch}", save_top_k=-1))
    if every_two is not None:  # saves that follow each other closely, in the background too
        callbacks.append(ModelCheckpoint(dirpath=every_two, every_n_train_steps=2, save_last=True))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=_world_size(),
        strategy=strategy,
        max_epochs=epochs,
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=checkpoint_dir is not None or every_two is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    micro = MICRO_BATCH * batch_scale
    module = LitGPT(MODEL, micro_batch_size=micro, optimizer="adamw", lr=1e-3)
    module.model.load_state_dict(make_model(init_seed).state_dict())
    dp = _world_size() // LAYOUT["pp_size"]
    loader = _loader(STEPS_PER_EPOCH, dp)
    if batch_scale != 1:
        size = loader.batch_size * batch_scale
        loader = DataLoader(loader.dataset, batch_size=size, shuffle=False, drop_last=True)
    trainer.fit(module, loader, ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
        # Complete on return, on every rank: read it back before anything else runs.
        saved_meta = (Path(save_to) / "meta.pt").is_file() if Path(save_to).is_dir() else None
    params = {n: _full(p) for n, p in module.model.named_parameters()}
    out = {"logged": record.logged, "params": params}
    if save_to is not None:
        out["saved_meta"] = saved_meta
    if state_dict_type == "full":  # the exporters' gather: the network alone, on rank 0
        out["network_state"] = strategy.full_state_dict()
    return out


def async_every_two(out: str, steps: int) -> dict[str, Any]:
    """`steps` steps with `async_save=True` and `ModelCheckpoint(every_n_train_steps=2,
    save_last=True)`: a save every other step, each followed by last.ckpt's."""
    root = Path(out)
    epochs = -(-steps // STEPS_PER_EPOCH)
    result = fit(epochs, async_save=True, every_two=root / "every2", max_steps=steps)
    return {"logged": len(result["logged"]), "files": sorted(os.listdir(root / "every2"))}
