"""What the parity tests share: the tiny model, the data, and single-process reference training."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lightning_zeropp.models import GPT, GPTConfig

MODEL = GPTConfig(vocab_size=64, seq_len=16, dim=32, num_heads=2, num_layers=8)
GLOBAL_BATCH = 16
MAX_NORM = 0.3  # small enough that clipping really scales the gradients


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(MODEL)


def make_batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (GLOBAL_BATCH, MODEL.seq_len)
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


def reference(optimizer: str, clip: bool, steps: int) -> dict[str, Any]:
    """Single-process fp32 training on the global batch: the numbers every layout must match."""
    model = make_model()
    opt = make_optimizer(optimizer, model.parameters())
    losses, norms = [], []
    for x, y in make_batches(steps):
        loss = lm_loss(model(x), y)
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}
