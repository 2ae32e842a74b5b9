"""A small GPT-style decoder, written as users write models (no pipeline code inside).

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

__all__ = ["GPT", "GPTConfig"]


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


class GPT(nn.Module):
    """Token ids (batch, time) -> logits (batch, time, vocab)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.num_layers)])
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) * math.sqrt(self.cfg.dim) * 0.1 + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x
