"""Validation metrics on gloo ranks: through the Lightning front and through the core engine.

Both evaluate the same fixed weights on the same rows; the test compares what every rank reports
with one process. Targets carry `IGNORE` at a different number of positions in every row, so a
mean of per-micro-batch values differs from the token-weighted value.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp import ZeroPPConfig, ZeroPPEngine, ZeroPPStrategy, launch_layout
from lightning_zeropp.metrics import CausalLMMetrics
from lightning_zeropp.models.lit_gpt import LitGPT
from tests.distributed.common import GLOBAL_BATCH, MODEL, make_batches, make_model

IGNORE = -100
NUM_BATCHES = 2

# Read at import: Lightning's cluster environment deletes WORLD_SIZE when a Trainer tears down
# (the test process imports this module for `reference` only, with no WORLD_SIZE).
_WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))


def rows() -> tuple[torch.Tensor, torch.Tensor]:
    """NUM_BATCHES global batches of (inputs, targets); row i ignores its first i % 7 targets."""
    batches = make_batches(NUM_BATCHES, seed=5)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches]).clone()
    for i in range(len(y)):
        y[i, : i % 7] = IGNORE
    return x, y


def run_cases(cases: list[dict[str, Any]]) -> dict[str, Any]:
    return {case.pop("id"): _RUNNERS[case.pop("front")](**case) for case in cases}


def lightning_validate(layout: dict[str, Any]) -> dict[str, float]:
    """`trainer.validate` of the bundled LitGPT: metrics logged in on_validation_epoch_end."""
    dp = _WORLD_SIZE // (layout.get("pp_size") or 1)
    micro = GLOBAL_BATCH // dp // layout["num_microbatches"]
    module = LitGPT(MODEL, micro_batch_size=micro)
    module.model.load_state_dict(make_model(0).state_dict())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=_WORLD_SIZE,
        strategy=ZeroPPStrategy(**layout),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(TensorDataset(*rows()), batch_size=GLOBAL_BATCH // dp, drop_last=True)
    (logged,) = trainer.validate(module, loader, verbose=False)
    return {k: float(v) for k, v in logged.items()}


def engine_eval(layout: dict[str, Any]) -> dict[str, float]:
    """The core engine's eval_step with metrics updated in the loss function (as the Accelerate
    recipe does); each data-parallel rank evaluates its own contiguous slice of every batch."""
    metrics = CausalLMMetrics(MODEL.vocab_size, ignore_index=IGNORE)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        metrics.update(logits, targets)
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return torch.nn.functional.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE)

    config = ZeroPPConfig(**layout).resolve(dist.get_world_size())
    per_rank = GLOBAL_BATCH // config.dp_size
    example = (torch.zeros(per_rank // config.num_microbatches, MODEL.seq_len, dtype=torch.long),)
    engine = ZeroPPEngine(
        make_model(0), launch_layout(config), loss_fn=loss_fn, example_args=example
    )
    engine.module.eval()
    x, y = rows()
    lo = engine.dims.dp_rank * per_rank
    for start in range(0, len(x), GLOBAL_BATCH):
        rank_rows = slice(start + lo, start + lo + per_rank)
        engine.eval_step(x[rank_rows], target=y[rank_rows])
    values = metrics.compute()
    # Only ranks holding the last stage updated; the rest must still agree after compute().
    values["updated_here"] = float(metrics.perplexity.update_called)
    return values


def reference() -> dict[str, float]:
    """One process, plain torch (no torchmetrics): the values every rank must report."""
    x, y = rows()
    with torch.no_grad():
        logits = make_model(0)(x).double()  # (rows, time, vocab)
    keep = y != IGNORE
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, MODEL.vocab_size), y.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    correct = ((logits.argmax(-1) == y) & keep).sum()
    return {
        "perplexity": float(torch.exp(nll / keep.sum())),
        "token_accuracy": float(correct / keep.sum()),
        # what a mean of per-batch perplexities would give: must differ, or the test proves little
        "naive_perplexity": float(
            torch.stack(
                [
                    torch.exp(lm_loss(logits[i : i + 4].float(), y[i : i + 4], IGNORE))
                    for i in range(0, len(x), 4)
                ]
            ).mean()
        ),
    }


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, ignore: int) -> torch.Tensor:
    flat = logits.reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(flat, targets.reshape(-1), ignore_index=ignore)


_RUNNERS = {"lightning": lightning_validate, "engine": engine_eval}
