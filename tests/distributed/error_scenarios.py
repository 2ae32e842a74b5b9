"""Bad input on every rank: each attempt must raise a clear error on all ranks, never hang."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp import ZeroPPConfig, ZeroPPEngine, ZeroPPStrategy
from lightning_zeropp.models.lit_gpt import LitGPT
from tests.distributed.common import MODEL, lm_loss, make_model


def _engine(model: nn.Module | None = None, split: str = "auto", **layout: Any) -> ZeroPPEngine:
    example = (torch.zeros(2, MODEL.seq_len, dtype=torch.long),)
    return ZeroPPEngine(
        model or make_model(),
        ZeroPPConfig(**layout),
        loss_fn=lm_loss,
        example_args=example,
        split=split,
    )


def _indivisible_batch() -> None:
    engine = _engine(pp_size=2, dp_shard_size=2, num_microbatches=4)
    x = torch.zeros(6, MODEL.seq_len, dtype=torch.long)
    engine.train_step(x, target=x)


def _shape_change() -> None:
    # Traced stages are fixed to the example's shapes (the call split takes any shape).
    engine = _engine(pp_size=2, dp_shard_size=2, num_microbatches=2, split="trace")
    for seq in (MODEL.seq_len, MODEL.seq_len // 2):
        x = torch.zeros(4, seq, dtype=torch.long)
        engine.train_step(x, target=x)


def _trainer(strategy: ZeroPPStrategy) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _lightning_bad_layout() -> None:
    _trainer(ZeroPPStrategy(pp_size=3)).fit(LitGPT(MODEL), [])


class _StepWithoutModel(LitGPT):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return batch[0].float().mean()  # never calls self.model: nothing to feed the pipeline


def _lightning_step_without_model() -> None:
    x = torch.zeros(8, MODEL.seq_len, dtype=torch.long)
    loader = DataLoader(TensorDataset(x, x), batch_size=2)
    _trainer(ZeroPPStrategy(pp_size=2)).fit(_StepWithoutModel(MODEL), loader)


def _lightning_dataset_smaller_than_a_batch() -> None:
    x = torch.zeros(6, MODEL.seq_len, dtype=torch.long)  # 2 data-parallel ranks of 3 rows
    loader = DataLoader(TensorDataset(x, x), batch_size=4, drop_last=True)
    _trainer(ZeroPPStrategy(pp_size=2)).fit(LitGPT(MODEL), loader)


ATTEMPTS = {
    "world_mismatch": lambda: _engine(pp_size=3),
    "too_few_microbatches": lambda: _engine(pp_size=4, num_microbatches=2),
    "more_stages_than_blocks": lambda: _engine(
        pp_size=4, schedule="interleaved_1f1b", num_chunks=4, num_microbatches=4
    ),
    "indivisible_batch": _indivisible_batch,
    "shape_change": _shape_change,
    "unknown_schedule": lambda: _engine(pp_size=2, schedule="pipedream"),
    "unsplittable_model": lambda: _engine(nn.Linear(4, 4), pp_size=2),
    "lightning_bad_layout": _lightning_bad_layout,
    "lightning_step_without_model": _lightning_step_without_model,
    "lightning_dataset_smaller_than_a_batch": _lightning_dataset_smaller_than_a_batch,
}


def attempt_all() -> dict[str, str]:
    """Each attempt's error, as 'Type: message' (or 'no error')."""
    out = {}
    for name, fn in ATTEMPTS.items():
        try:
            fn()
            out[name] = "no error"
        except Exception as err:  # noqa: BLE001 - the test inspects what was raised
            out[name] = f"{type(err).__name__}: {err}"
    return out
