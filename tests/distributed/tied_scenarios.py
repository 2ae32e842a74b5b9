"""Tied input/output embeddings (HF `tie_word_embeddings=True`) on gloo ranks, and what the
single-process reference needs to train the same models (importable without a process group).

The models are plain `AutoModelForCausalLM.from_config(...)` (no `models.hf` preparation), so the
engine's default split ("call") pipelines them: the embedding's copy lives on the first stage, the
head's on the last, and the engine sums their gradients after every step (`core.split.tied`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from tests.distributed.common import GLOBAL_BATCH, MAX_NORM, MODEL, make_batches, make_optimizer

TINY = {
    "vocab_size": MODEL.vocab_size,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "use_cache": False,
}
EXTRA = {"llama": {}, "gemma": {"head_dim": 8, "pad_token_id": 0}}
TIED = {
    "hf": ("model.embed_tokens.weight", "lm_head.weight"),
    "gpt": ("tok_emb.weight", "head.weight"),
}


def make_tied(family: str, seed: int = 0) -> nn.Module:
    """A tiny tied causal LM: an HF family, or the bundled GPT (which follows split='stack''s
    contract) with its head tied to its token embedding."""
    torch.manual_seed(seed)
    if family == "gpt":
        from lightning_zeropp.models import GPT

        model = GPT(MODEL)
        model.head.weight = model.tok_emb.weight
        return model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **TINY, **EXTRA[family])
    model = AutoModelForCausalLM.from_config(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def tied_names(family: str) -> tuple[str, str]:
    return TIED["gpt" if family == "gpt" else "hf"]


def model_loss(family: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One process's loss: HF's own (labels passed to the model), or cross-entropy of the GPT."""
    if family == "gpt":
        return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    return model(x, labels=y).loss


# ------------------------------------------------------------------------------ core engine
def engine_cases(cases: list[dict[str, Any]], checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Every parity case, the checkpoint round trip and the trace refusal, in one launch."""
    out: dict[str, Any] = {case.pop("id"): _train(**case) for case in cases}
    out["checkpoint"] = checkpoint_round_trip(**checkpoint)
    out["from_one_process"] = load_one_process_state(checkpoint["layout"])
    try:  # a traced graph cannot keep copies apart: refused, on every rank
        _engine("gpt", {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 4}, "trace")
        out["trace_error"] = ""
    except ValueError as err:
        out["trace_error"] = str(err)
    return out


def _engine(family: str, layout: dict[str, Any], split: str = "call", seed: int = 0) -> Any:
    from lightning_zeropp import launch_layout
    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine

    config = ZeroPPConfig(**layout).resolve(torch.distributed.get_world_size())
    micro = GLOBAL_BATCH // config.dp_size // config.num_microbatches
    ids = torch.zeros(micro, MODEL.seq_len, dtype=torch.long)
    if family == "gpt":
        loss_fn, kwargs = _gpt_loss, {}
    else:  # HF computes the loss: labels= is a model input, the loss reads it off the output
        loss_fn, kwargs = (lambda out, labels: out.loss), {"labels": ids}
    model = make_tied(family, seed)
    return ZeroPPEngine(
        model,
        launch_layout(config),
        loss_fn=loss_fn,
        split=split,
        example_args=(ids,),
        example_kwargs=kwargs,
    )


def _gpt_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _step(engine: Any, family: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    per_rank = GLOBAL_BATCH // engine.dims.dp_size
    rows = slice(engine.dims.dp_rank * per_rank, (engine.dims.dp_rank + 1) * per_rank)
    if family == "gpt":
        return engine.train_step(x[rows], target=y[rows])
    return engine.train_step(x[rows], labels=y[rows], target=y[rows])


def _train(
    family: str,
    layout: dict[str, Any],
    optimizer: str = "sgd",
    split: str = "call",
    clip: bool = False,
    steps: int = 3,
    accumulate: int = 1,
    export: bool = False,
) -> dict[str, Any]:
    engine = _engine(family, layout, split)
    opt = make_optimizer(optimizer, engine.parameters())
    losses, norms = [], []
    for i, (x, y) in enumerate(make_batches(steps * accumulate)):
        losses.append(float(_step(engine, family, x, y)))  # gradients add up, as backward's do
        if (i + 1) % accumulate:
            continue
        if clip:
            norms.append(float(engine.clip_grad_norm_(MAX_NORM)))
        opt.step()
        opt.zero_grad()
    out = {"losses": losses, "norms": norms, "params": _params(engine.module)}
    if export:
        from lightning_zeropp.core.weights.export import full_optimizer_state_dict, full_state_dict

        out["full"] = full_state_dict(engine.module, engine.dims)
        out["full_optimizer"] = full_optimizer_state_dict(engine.module, opt, engine.dims)
    return out


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _full(p) for n, p in module.named_parameters()}


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def checkpoint_round_trip(out: str, layout: dict[str, Any], load_layout: dict[str, Any]) -> Any:
    """2 steps, a distributed checkpoint, then a fresh engine (other initial weights, under
    `load_layout`) loads it and takes step 3: the 3 steps of one process."""
    from lightning_zeropp.core.weights.checkpoint import load_checkpoint, save_checkpoint

    batches = make_batches(3)
    engine = _engine("llama", layout)
    opt = make_optimizer("adamw", engine.parameters())
    losses = []
    for x, y in batches[:2]:
        losses.append(float(_step(engine, "llama", x, y)))
        opt.step()
        opt.zero_grad()
    saved = _params(engine.module)
    save_checkpoint(Path(out) / "ckpt", engine.module, [opt])
    fresh = _engine("llama", load_layout, seed=7)
    fresh_opt = make_optimizer("adamw", fresh.parameters())
    before = _params(fresh.module)
    load_checkpoint(Path(out) / "ckpt", fresh.module, [fresh_opt])
    loaded = _params(fresh.module)
    losses.append(float(_step(fresh, "llama", *batches[2])))
    fresh_opt.step()
    return {
        "saved": saved,
        "before": before,
        "loaded": loaded,
        "losses": losses,
        "params": _params(fresh.module),
    }


def load_one_process_state(layout: dict[str, Any]) -> dict[str, Any]:
    """One process trains 2 steps (AdamW) and keeps `model.state_dict()` and a plain
    `optimizer.state_dict()` (numbered, no names: the tied weight once); a fresh engine (other
    weights) loads both with `load_full` and takes step 3."""
    from lightning_zeropp.core.weights.checkpoint import load_full

    batches = make_batches(3)
    model = make_tied("llama")
    opt = make_optimizer("adamw", model.parameters())
    for x, y in batches[:2]:
        model_loss("llama", model, x, y).backward()
        opt.step()
        opt.zero_grad()
    engine = _engine("llama", layout, seed=7)
    fresh = make_optimizer("adamw", engine.parameters())
    load_full(engine.module, [fresh], model.state_dict(), [opt.state_dict()])
    loss = float(_step(engine, "llama", *batches[2]))
    fresh.step()
    return {"loss": loss, "params": _params(engine.module)}


# ------------------------------------------------------------------------------ Lightning
class _Rows(torch.utils.data.Dataset):
    """Dict rows, as HF datasets give them."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.y[i]}


def lightning_fit(family: str, layout: dict[str, Any], steps: int = 3) -> dict[str, Any]:
    """A LightningModule as users write one around an HF model, trained through the strategy."""
    import lightning.pytorch as pl

    from lightning_zeropp import ZeroPPStrategy

    class TiedLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_tied(family)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self.model(batch["input_ids"], labels=batch["labels"]).loss
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer("sgd", self.parameters())

    from tests.distributed.lightning_scenarios import Record

    world = int(os.environ["WORLD_SIZE"])
    record = Record()
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
        callbacks=[record],
    )
    lit = TiedLM()
    batches = make_batches(steps)
    data = _Rows(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    dp = world // layout["pp_size"]
    trainer.fit(lit, DataLoader(data, batch_size=GLOBAL_BATCH // dp, drop_last=True))
    return {"logged": record.logged, "params": _params(lit.model)}
