"""Scenario: a post-norm transformer (each block ends in a LayerNorm) trained under ZeroPP's split
backward, whose held-back weight-gradient tasks on released chunks start at the blocks' outputs."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zeropp import launch_layout
from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine

VOCAB, DIM, SEQ, BATCH = 32, 16, 8, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.tanh(self.lin(x)))


class PostNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(8))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def train(layout: dict[str, Any], steps: int = 2) -> dict[str, Any]:
    config = ZeroPPConfig(**layout).resolve(torch.distributed.get_world_size())
    torch.manual_seed(0)
    rows = BATCH // config.dp_size
    example = (torch.zeros(rows // config.num_microbatches, SEQ, dtype=torch.long),)
    engine = ZeroPPEngine(PostNorm(), launch_layout(config), loss_fn=loss_fn, example_args=example)
    opt = torch.optim.SGD(list(engine.parameters()), lr=0.5)
    mine = slice(engine.dims.dp_rank * rows, (engine.dims.dp_rank + 1) * rows)
    losses = []
    for x, y in batches(steps):
        losses.append(float(engine.train_step(x[mine], target=y[mine])))
        opt.step()
        opt.zero_grad()
    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in engine.module.named_parameters()
    }
    return {"losses": losses, "params": params}
