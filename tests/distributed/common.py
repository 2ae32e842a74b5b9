"""What the parity tests share: the tiny model, the data, and single-process reference training."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zeropp.models import GPT, GPTConfig

MODEL = GPTConfig(vocab_size=64, seq_len=16, dim=32, num_heads=2, num_layers=8)
# The same GPT with a vocabulary that makes its head and loss cost about three blocks: stages cut
# by cost move blocks off the rank that holds the head.
BIG_HEAD = GPTConfig(vocab_size=1280, seq_len=16, dim=32, num_heads=2, num_layers=8)
GLOBAL_BATCH = 16
MAX_NORM = 0.3  # small enough that clipping really scales the gradients


def make_model(seed: int = 0, config: GPTConfig = MODEL) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def make_batches(
    steps: int, seed: int = 1, global_batch: int = GLOBAL_BATCH
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (global_batch, MODEL.seq_len)
    return [
        (torch.randint(0, MODEL.vocab_size, shape, generator=g),) * 1
        + (torch.randint(0, MODEL.vocab_size, shape, generator=g),)
        for _ in range(steps)
    ]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.1)
    raise ValueError(kind)


def sampler_batches(steps: int, epochs: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches Lightning's injected DistributedSampler yields (it always shuffles the
    training data, seeded by epoch): data-parallel ranks each take a strided slice of one
    permutation, so step k's global batch is rows [k*B, (k+1)*B) of that permutation."""
    batches = make_batches(steps)
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    out = []
    for epoch in range(epochs):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        out += [(x[i], y[i]) for i in perm.split(GLOBAL_BATCH)]
    return out


# The bundled GPT's reference runs by their arguments: the suite asks for the same few hundreds of
# times (every layout of a parity sweep against one process), and each is a real training run.
_REFERENCES: dict[tuple[Any, ...], dict[str, Any]] = {}


def reference(
    optimizer: str,
    clip: bool,
    steps: int,
    batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    accumulate: int = 1,
    lr_schedule: tuple[int, int] | None = None,
    global_batch: int = GLOBAL_BATCH,
    model_fn: Callable[[], nn.Module] | None = None,
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Single-process fp32 training on the global batch: the numbers every layout must match.

    `lr_schedule=(warmup_steps, max_steps)` steps the bundled LitGPT's warm-up + cosine schedule
    after every optimizer step, as Lightning does for `interval="step"`. `model_fn()` builds
    another model (default: the bundled GPT) and `loss_fn(model, x, y)` computes its loss
    (default: `lm_loss(model(x), y)`). Runs of the bundled GPT on its own batches are computed
    once per process and handed out as copies (a test may change what it gets).
    """
    if batches is not None or model_fn is not None or loss_fn is not None:
        return _reference(optimizer, clip, steps, batches, accumulate, lr_schedule, global_batch,
                          model_fn, loss_fn)  # fmt: skip
    key = (optimizer, clip, steps, accumulate, lr_schedule, global_batch)
    if key not in _REFERENCES:
        run = _reference(*key[:3], None, *key[3:], None, None)
        _REFERENCES[key] = {**run, "rng": torch.get_rng_state()}
    run = copy.deepcopy(_REFERENCES[key])
    torch.set_rng_state(run.pop("rng"))  # the global generator where computing it leaves it
    return run


def _reference(
    optimizer: str,
    clip: bool,
    steps: int,
    batches: list[tuple[torch.Tensor, torch.Tensor]] | None,
    accumulate: int,
    lr_schedule: tuple[int, int] | None,
    global_batch: int,
    model_fn: Callable[[], nn.Module] | None,
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None,
) -> dict[str, Any]:
    model = model_fn() if model_fn is not None else make_model()
    opt = make_optimizer(optimizer, model.parameters())
    sched = None
    if lr_schedule is not None:
        from lightning_zeropp.models.lit_gpt import LitGPT

        factor = LitGPT(MODEL, warmup_steps=lr_schedule[0], max_steps=lr_schedule[1])._lr_factor
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    losses, norms = [], []
    batches = batches if batches is not None else make_batches(steps, global_batch=global_batch)
    for i, (x, y) in enumerate(batches):
        loss = loss_fn(model, x, y) if loss_fn is not None else lm_loss(model(x), y)
        (loss / accumulate).backward()
        losses.append(float(loss.detach()))
        if (i + 1) % accumulate:
            continue
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}
