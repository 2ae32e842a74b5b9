"""A small GPT-style decoder, written as users write models (no pipeline code inside).

Given targets, `GPT(x, targets)` returns the mean cross-entropy over the targets that are not
`ignore_index`, its head and loss computed over chunks of tokens (`core.step.chunked_loss`), so the
logits never exist whole; without, it returns the logits.

It follows the pipeline-friendly contract of `core.split` ("stack" mode): its blocks live in one
`ModuleList`, and its forward skips modules that are `None`, so a stage can be a pruned copy of the
model. The tracing front end needs no contract and splits it as is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zeropp.core.step.chunked_loss import linear_cross_entropy

__all__ = ["GPT", "GPTConfig", "Head"]


@dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    dim: int = 128
    num_heads: int = 4
    num_layers: int = 8
    mlp_ratio: int = 4


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        # No qkv bias (as in Llama): the key bias has an exactly-zero gradient (softmax ignores a
        # per-query shift), so Adam would turn its round-off noise into lr-sized updates.
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # (batch, time, dim)
        q, k, v = self.qkv(x).split(d, dim=-1)
        # (batch, heads, time, head_dim)
        q, k, v = (
            z.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2) for z in (q, k, v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Linear):
    """The output projection; given targets, the mean cross-entropy of its logits over the
    targets that are not `ignore_index` (0 when there are none), computed chunk by chunk.

    The loss is computed inside the head's own call, so a pipeline stage or a sharding wrapper
    sees one module call using the head's weight, as with plain logits."""

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, ignore_index: int = -100
    ) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        total = linear_cross_entropy(x, self.weight, self.bias, targets, ignore_index=ignore_index)
        count = (targets != ignore_index).sum()
        return total / count.clamp(min=1).to(total.dtype)


class GPT(nn.Module):
    """Token ids (batch, time) -> logits (batch, time, vocab); with `targets` (batch, time), the
    mean cross-entropy over the targets that are not `ignore_index`, as a scalar."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.num_layers)])
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = Head(cfg.dim, cfg.vocab_size, bias=False)

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, ignore_index: int = -100
    ) -> torch.Tensor:
        if self.tok_emb is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) * math.sqrt(self.cfg.dim) * 0.1 + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x) if targets is None else self.head(x, targets, ignore_index)
        return x
