"""Scenarios run on gloo ranks through the Accelerate front, and their single-process references.

`run` is an ordinary Accelerate training loop (what a user writes), with `prepare_pipeline` where
`accelerator.prepare` would be; `reference` runs the same user code (same model, optimizer, param
groups, scheduler, clipping, accumulation) in one process on the global batch.
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_zeropp.accelerate import prepare_pipeline
from lightning_zeropp.core.settings.config import ZeroPPConfig
from tests.distributed.common import (
    GLOBAL_BATCH,
    MAX_NORM,
    MODEL,
    lm_loss,
    make_batches,
    make_model,
)

PG_TIMEOUT = datetime.timedelta(seconds=120)
WARMUP = 2  # LinearLR warm-up steps, then cosine annealing


# ------------------------------------------------------------------------- the user's objects
def make_llama(seed: int = 0) -> nn.Module:
    """A tiny HF Llama built from a config (no download); untied head, no KV cache (traceable)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def llama_split(micro_rows: int) -> Callable[[nn.Module, int, int, list[range]], nn.Module]:
    """Split callable: torch's tracing front end, run under `torch.no_grad()`.

    Traced with grad enabled, the rotary embedding's `@torch.no_grad()` forward becomes a
    `wrap_with_set_grad_enabled` region that torch 2.13's unflattening turns into a call without
    arguments, and stage 0 fails at its first forward. Traced without grad there is no such
    region; the graph is the same and trains (no gradient crossed that region anyway).
    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    example = (torch.zeros(micro_rows, MODEL.seq_len, dtype=torch.long),)
    traced: dict[str, Any] = {}

    def split(model: nn.Module, stage: int, num_stages: int, ranges: list[range]) -> nn.Module:
        if "pipe" not in traced:
            spec = {f"model.layers.{r.start}": SplitPoint.BEGINNING for r in ranges[1:]}
            with torch.no_grad():
                traced["pipe"] = pipeline(model, mb_args=example, split_spec=spec)
        return traced["pipe"].get_stage_module(stage)

    return split


def llama_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Loss from the logits, whatever the output holds them in (a tensor, tuple or ModelOutput)."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return lm_loss(logits, labels)


def user_objects(
    model: nn.Module, optimizer: str, schedule: str, steps_per_update: int = 1
) -> tuple[torch.optim.Optimizer, Any]:
    """What a user builds on the whole model: param groups by name, and an LR scheduler.

    Three AdamW groups: weight matrices with decay; biases and norms without; embeddings at half
    the learning rate. The embedding group is empty on every stage but the first.
    `steps_per_update`: the scheduler steps this many times per optimizer step (Accelerate's
    convention when each data-parallel rank loads a whole batch).
    """
    groups: dict[str, list[nn.Parameter]] = {"decay": [], "no_decay": [], "emb": []}
    for name, p in model.named_parameters():
        if "emb" in name:
            groups["emb"].append(p)
        elif p.dim() >= 2:
            groups["decay"].append(p)
        else:
            groups["no_decay"].append(p)
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    else:
        opt = torch.optim.AdamW(
            [
                {"params": groups["decay"], "weight_decay": 0.1},
                {"params": groups["no_decay"], "weight_decay": 0.0},
                {"params": groups["emb"], "weight_decay": 0.0, "lr": 5e-4},
            ],
            lr=1e-3,
            eps=1e-6,
        )
    if schedule == "sequential":  # linear warm-up, then cosine: a composite scheduler
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.3, total_iters=WARMUP)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6, eta_min=1e-5)
        return opt, torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[WARMUP])
    if schedule == "lambda":  # warm-up + cosine as one lambda, in optimizer steps
        return opt, torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: _warmup_cosine(s // steps_per_update)
        )
    raise ValueError(schedule)


def _warmup_cosine(step: int, max_steps: int = 6) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - WARMUP) / (max_steps - WARMUP))))


class DictRows(Dataset):
    """(x, y) rows as HF-style dicts."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.y[i]}


def dataset(num_batches: int, dicts: bool = False) -> Dataset:
    """`num_batches` global batches of rows, in order."""
    batches = make_batches(num_batches)
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    return DictRows(x, y) if dicts else TensorDataset(x, y)


# ------------------------------------------------------------------------- on the ranks
def run_cases(cases: list[dict[str, Any]], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Several runs in one process tree (each with its own Accelerator and engine)."""
    os.environ.update(env or {})
    return {case.pop("id"): run(**case) for case in cases}


def prepare_only(env: dict[str, str]) -> dict[str, Any]:
    """`prepare_pipeline` with the layout from `env` (bad settings must fail here, everywhere)."""
    os.environ.update(env)
    accelerator = Accelerator(
        cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=PG_TIMEOUT)]
    )
    net = make_model()
    opt, sched = user_objects(net, "adamw", "sequential")
    train_dl = DataLoader(dataset(1), batch_size=GLOBAL_BATCH, drop_last=True)
    engine, *_ = prepare_pipeline(accelerator, net, opt, train_dl, sched, loss_fn=lm_loss)
    return {"dp": (engine.dims.dp_rank, engine.dims.dp_size, engine.dims.pp_rank)}


def resume(case: dict[str, Any], save_to: str) -> dict[str, Any]:
    """6 steps straight, against 3 steps + save_state + a fresh run (other weights) resuming."""
    full = run(**case, steps=6)
    first = run(**case, steps=3, save_to=save_to)
    resumed = run(**case, steps=6, resume_from=save_to, skip=3, init_seed=7)
    return {"full": full, "first": first, "resumed": resumed}


def run(
    layout: dict[str, Any] | None = None,
    model: str = "gpt",
    optimizer: str = "adamw",
    schedule: str = "sequential",
    split_batches: bool = True,
    split: str | None = None,
    accumulate: int = 1,
    clip: bool = True,
    steps: int = 3,
    init_seed: int = 0,
    save_to: str | None = None,
    resume_from: str | None = None,
    skip: int = 0,
    validate: bool = False,
) -> dict[str, Any]:
    """An Accelerate training loop on `steps` optimizer steps; layout None reads ZEROPP_*."""
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=accumulate,
        dataloader_config=DataLoaderConfiguration(split_batches=split_batches),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=PG_TIMEOUT)],
    )
    if model == "prepared_llama":  # models.hf's: it asks for the trace split
        from lightning_zeropp.models.hf import prepare_causal_lm

        net = prepare_causal_lm(make_llama(init_seed))
    else:
        net = make_llama(init_seed) if model == "llama" else make_model(init_seed)
    config = ZeroPPConfig(**layout) if layout is not None else None
    resolved = _resolved(config)
    dp = resolved.dp_size
    per_update = 1 if split_batches else dp
    opt, sched = user_objects(net, optimizer, schedule, per_update)
    # The loader's batch is the global batch when split, one data-parallel rank's otherwise.
    batch_size = GLOBAL_BATCH if split_batches else GLOBAL_BATCH // dp
    hf = model in ("llama", "prepared_llama")
    data = dataset(steps * accumulate, dicts=hf)
    train_dl = DataLoader(data, batch_size=batch_size, shuffle=False, drop_last=True)
    loss_fn = llama_loss if hf else lm_loss
    split_fn: Any = split
    if model == "llama" and split is None:
        rows = GLOBAL_BATCH // dp  # per data-parallel rank, either way
        split_fn = llama_split(rows // resolved.num_microbatches)
    engine, opt, train_dl, sched = prepare_pipeline(
        accelerator, net, opt, train_dl, sched, loss_fn=loss_fn, config=config, split=split_fn
    )
    del net  # the engine holds this rank's stages
    if resume_from is not None:
        accelerator.load_state(resume_from)
        train_dl = accelerator.skip_first_batches(train_dl, skip)
    losses, norms, lrs = [], [], []
    for batch in train_dl:
        with accelerator.accumulate():
            losses.append(float(engine.step(batch)))
            if accelerator.sync_gradients and clip:
                norms.append(float(engine.clip_grad_norm_(MAX_NORM)))
            opt.step()
            sched.step()
            opt.zero_grad()
            if accelerator.sync_gradients:
                lrs.append([float(lr) for lr in sched.get_last_lr()])
    if save_to is not None:
        accelerator.save_state(save_to)
    out: dict[str, Any] = {"losses": losses, "norms": norms, "lrs": lrs}
    if validate:
        val = DataLoader(dataset(2, dicts=hf), batch_size=batch_size, drop_last=True)
        engine.eval()
        out["val_losses"] = [float(engine.eval_step(b)) for b in engine.prepare_data_loader(val)]
        engine.train()
    out["params"] = {n: _full(p) for n, p in engine.named_parameters()}
    out["dp"] = (engine.dims.dp_rank, engine.dims.dp_size, engine.dims.pp_rank)
    out["split"] = engine.core.split if isinstance(engine.core.split, str) else "callable"
    return out


# ------------------------------------------------------------------------- one process
def reference(
    model: str = "gpt",
    optimizer: str = "adamw",
    schedule: str = "sequential",
    accumulate: int = 1,
    clip: bool = True,
    steps: int = 3,
    validate: bool = False,
    **_: Any,
) -> dict[str, Any]:
    """The same user code in one process on the global batch: what every layout must match."""
    net = make_llama() if model == "llama" else make_model()
    opt, sched = user_objects(net, optimizer, schedule)
    loss_fn = llama_loss if model == "llama" else lm_loss
    losses, norms, lrs = [], [], []
    for i, (x, y) in enumerate(make_batches(steps * accumulate)):
        loss = loss_fn(net(x), y)
        (loss / accumulate).backward()
        losses.append(float(loss.detach()))
        if (i + 1) % accumulate:
            continue
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)))
        opt.step()
        sched.step()
        opt.zero_grad()
        lrs.append([float(lr) for lr in sched.get_last_lr()])
    out: dict[str, Any] = {"losses": losses, "norms": norms, "lrs": lrs}
    if validate:
        with torch.no_grad():
            out["val_losses"] = [float(loss_fn(net(x), y)) for x, y in make_batches(2)]
    out["params"] = {n: p.detach().clone() for n, p in net.named_parameters()}
    return out


def _resolved(config: ZeroPPConfig | None) -> ZeroPPConfig:
    """The layout the ranks will run (the test's, or the one the ZEROPP_* variables give)."""
    if config is None:
        from lightning_zeropp.accelerate import config_from_env

        config = config_from_env()
    return config.resolve(int(os.environ["WORLD_SIZE"]))


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
