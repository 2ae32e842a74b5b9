"""Context parallelism (cp_size > 1) through the fronts, on gloo ranks: a Lightning `Trainer`
with the bundled LitGPT, an Accelerate run_clm-style loop and `ZeroPPTrainer` with an HF Llama
on right-padded rows. Each reports what one process is compared with."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.models.lit_gpt import LitGPT
from tests.distributed.common import GLOBAL_BATCH, MAX_NORM, MODEL, make_batches, make_model
from tests.distributed.lightning_scenarios import Record, _full

# Read once: Lightning's cluster environment deletes WORLD_SIZE when a Trainer tears down.
_WORLD_SIZE = int(os.environ["WORLD_SIZE"])


def _dp(layout: dict[str, Any]) -> int:
    return _WORLD_SIZE // (layout.get("pp_size", 1) * layout.get("cp_size", 1))


def _gpt_loader(steps: int, dp: int) -> DataLoader:
    batches = make_batches(steps)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    return DataLoader(
        TensorDataset(x, y), batch_size=GLOBAL_BATCH // dp, shuffle=False, drop_last=True
    )


class _PredictingGPT(LitGPT):
    """The bundled LitGPT with a `predict_step` returning its logits (a user's one line)."""

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


def lightning_fit(layout: dict[str, Any], steps: int = 3, split: str = "call") -> dict[str, Any]:
    """The unmodified bundled LitGPT through `Trainer(strategy=ZeroPPStrategy(cp_size=...))`:
    AdamW, clipping by norm, then a validation pass and predictions."""
    strategy = ZeroPPStrategy(split=split, **layout)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=_WORLD_SIZE,
        strategy=strategy,
        max_steps=steps,
        gradient_clip_val=MAX_NORM,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    dp = _dp(layout)
    micro = GLOBAL_BATCH // dp // layout.get("num_microbatches", layout.get("pp_size", 1))
    module = _PredictingGPT(MODEL, micro_batch_size=micro, optimizer="adamw", lr=1e-3)
    module.model.load_state_dict(make_model(0).state_dict())
    record = Record()
    trainer.callbacks.append(record)
    trainer.fit(module, _gpt_loader(steps, dp))
    val = trainer.validate(module, _gpt_loader(steps, dp), verbose=False)
    params = {n: _full(p) for n, p in module.model.named_parameters()}
    predicted = trainer.predict(module, _gpt_loader(1, dp))
    return {
        "predictions": torch.cat([p.detach() for p in predicted]),
        "logged": record.logged,
        "returned": record.returned,
        "params": params,
        "val_loss": float(val[0]["val_loss"]),
    }


def lightning_resumed(case: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """A fit under `case["saved"]` stopped by `max_steps=case["stop"]` (epochs of 2 steps: 1 is
    mid-epoch 0, 2 its end) and `trainer.save_checkpoint` (a sharded folder), then
    `fit(ckpt_path=...)` under `case["resumed"]` from other initial weights up to step 4: the
    losses logged and the parameters after (the uninterrupted run's, one process)."""
    path = os.path.join(out_dir, case["id"] + ".ckpt")
    out: dict[str, Any] = {}
    for layout, seed, steps, resume in (
        (case["saved"], 0, case["stop"], None),
        (case["resumed"], 7, 4, path),
    ):
        trainer = pl.Trainer(
            accelerator="cpu", devices=_WORLD_SIZE, strategy=ZeroPPStrategy(split="call", **layout),
            max_steps=steps, gradient_clip_val=MAX_NORM, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            deterministic=True,
        )  # fmt: skip
        dp = _dp(layout)
        micro = GLOBAL_BATCH // dp // layout.get("num_microbatches", layout.get("pp_size", 1))
        module = LitGPT(MODEL, micro_batch_size=micro, optimizer="adamw", lr=1e-3)
        module.model.load_state_dict(make_model(seed).state_dict())
        record = Record()
        trainer.callbacks.append(record)
        trainer.fit(module, _gpt_loader(2, dp), ckpt_path=resume)
        if resume is None:
            trainer.save_checkpoint(path)
        out = {
            "logged": record.logged,
            "params": {n: _full(p) for n, p in module.model.named_parameters()},
        }
    return out


def trainer_resumed(case: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """`ZeroPPTrainer` saving `checkpoint-<step>` every 2 of 4 steps under `case["saved"]`, then
    a fresh run from other initial weights resuming from checkpoint-2 (mid-epoch) under
    `case["resumed"]`: its logs and final weights (the uninterrupted run's, one process)."""
    from tests.distributed.trainer_scenarios import _run_case

    folder = Path(out_dir) / case["id"]
    _run_case({"plugin": case["saved"], "script": case["script"]}, folder)
    again = {"plugin": case["resumed"], "script": {**case["script"], "init_seed": 7}}
    return _run_case(again, folder / "again", resume=str(folder / "checkpoint-2"))


def run(
    lightning: list[dict[str, Any]],
    accelerate: list[dict[str, Any]] | None = None,
    trainer: list[dict[str, Any]] | None = None,
    out_dir: str = "",
    hf_lightning: list[dict[str, Any]] | None = None,
    devices: int = 4,
    across: list[dict[str, Any]] | None = None,
    lightning_across: list[dict[str, Any]] | None = None,
    trainer_across: list[dict[str, Any]] | None = None,
    last_loss: list[dict[str, Any]] | None = None,
    trl: list[dict[str, Any]] | None = None,
    trl_dpo: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Every front's cases in one launch: Accelerate's first (Accelerate makes the process
    group; the Lightning Trainer then uses it)."""
    from tests.distributed import clm_scenarios, trainer_scenarios

    out: dict[str, Any] = {}
    if accelerate:
        out |= clm_scenarios.run(accelerate)
    if trainer:
        out |= trainer_scenarios.run(trainer, out_dir)
    if last_loss:  # a loss of the loop's or the Trainer's own, on the last stage
        from tests.distributed import last_loss_scenarios

        out |= last_loss_scenarios.run(last_loss, out_dir)
    if trl:  # TRL's SFT, its loss on the last stage
        from tests.distributed import trl_scenarios

        out |= trl_scenarios.run(trl, out_dir)
    if trl_dpo:  # TRL's DPO: a loss over pairs of rows on the last stage's whole sequences
        from tests.distributed import trl_dpo_scenarios

        out |= trl_dpo_scenarios.run(trl_dpo, out_dir)
    for case in across or ():  # 2 updates and save_state under one cp, the rest under another
        save_to = os.path.join(out_dir, case["id"])
        first = {"args": {**case["args"], "stop_after": 2}, "save_to": save_to}
        clm_scenarios.run([{**first, "id": "first", "plugin": case["saved"]}])
        again = {**case["args"], "resume_from": save_to, "resumed_updates": 2, "init_seed": 7}
        resumed = {"id": case["id"], "plugin": case["resumed"], "args": again}
        out |= clm_scenarios.run([resumed])
    for case in trainer_across or ():  # checkpoint-2 of 4 steps resumed under another cp
        out[case["id"]] = trainer_resumed(case, out_dir)
    for case in lightning:
        out[case["id"]] = lightning_fit(case["layout"])
    for case in lightning_across or ():  # a sharded checkpoint resumed under another cp_size
        out[case["id"]] = lightning_resumed(case, out_dir)
    from tests.distributed import hf_lightning_scenarios

    for case in hf_lightning or ():  # an HF model's own loss from labels, in a LightningModule
        out[case["id"]] = hf_lightning_scenarios.run(
            "llama", case["strategy"], devices, validate=True, pad_to_multiple_of=4
        )
    return out
