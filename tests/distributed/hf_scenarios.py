"""HF causal LMs through `Trainer(strategy=ZeroPPStrategy(...))`, then exported; and what the
single-process reference needs to train the same models (importable without a process group)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zeropp.models.hf import build_causal_lm
from lightning_zeropp.models.lit_causal_lm import LitCausalLM
from tests.distributed.common import GLOBAL_BATCH, MODEL

# Tiny decoders over the parity tests' data (vocab 64, 16 tokens per row); head_dim is given
# because Qwen3's default (128) would dwarf the 32-wide model.
TINY = {
    "vocab_size": MODEL.vocab_size,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 64,
}

# loss modes: "labels" and "logits" are LitCausalLM's (targets already shifted, every position);
# "hf_labels" is a step written the HF way, `model(x, labels=x).loss` (shifted inside the loss).
LOSSES = ("labels", "logits", "hf_labels")


def make_hf_model(family: str, seed: int = 0) -> nn.Module:
    return build_causal_lm(family, seed=seed, **TINY)


def reference_loss(mode: str) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss each mode must equal, written out by hand (not through HF's loss function)."""

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x).logits.float()  # (batch, time, vocab)
        if mode == "hf_labels":  # position t predicts x[t + 1]; the last position has no target
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    return loss


class HFLabelsLit(LitCausalLM):
    """A step in HF's own words: labels are the inputs, the model shifts them."""

    def _loss(self, batch: Any) -> torch.Tensor:
        input_ids, _ = batch
        return self.model(input_ids=input_ids, labels=input_ids).loss


def fit_cases(cases: list[dict[str, Any]]) -> dict[str, Any]:
    return {case.pop("id"): fit_hf(**case) for case in cases}


def fit_hf(
    family: str,
    loss: str,
    layout: dict[str, Any],
    export_to: str,
    optimizer: str = "sgd",
    steps: int = 3,
    validate: bool = False,
) -> dict[str, Any]:
    """Train 3 steps under ZeroPP, export to `export_to`; report losses and full parameters."""
    import lightning.pytorch as pl

    from lightning_zeropp import ZeroPPStrategy
    from tests.distributed.lightning_scenarios import Record, _full, _loader, _lr, _world_size

    world = _world_size()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ZeroPPStrategy(**layout),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    dp = world // layout["pp_size"]
    micro = GLOBAL_BATCH // dp // layout["num_microbatches"]
    cls = HFLabelsLit if loss == "hf_labels" else LitCausalLM
    module = cls(
        make_hf_model(family),
        micro_batch_size=micro,
        seq_len=MODEL.seq_len,
        lr=_lr(optimizer),
        optimizer=optimizer,
        loss="labels" if loss == "hf_labels" else loss,
        # the reference's AdamW (tests.distributed.common.make_optimizer)
        weight_decay=0.1,
        eps=1e-6,
    )
    record = Record()
    trainer.callbacks.append(record)
    trainer.fit(module, _loader(steps, dp))
    val = trainer.validate(module, _loader(steps, dp), verbose=False) if validate else None
    module.export_hf(export_to)
    params = {n: _full(p) for n, p in module.model.named_parameters()}
    out = {"logged": record.logged, "returned": record.returned, "params": params}
    return out | ({"val_loss": val[0]["val_loss"]} if val else {})
