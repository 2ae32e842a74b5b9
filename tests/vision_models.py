"""A module shaped exactly like torchvision's `VisionTransformer` (torchvision is not a dependency).

Same module tree, parameter names and forward as `torchvision.models.VisionTransformer` (without
the conv stem option): a patchifying conv, a class token held by the model, an `Encoder` holding a
position table, an `nn.Sequential` of `EncoderBlock`s whose MLP is itself an `nn.Sequential` of
Linear, GELU, Dropout, Linear, Dropout (5 children: more than a 4-layer encoder has), and a head
reading the class token's row. Tests of the block rule use it as torchvision users would.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn


class MLPBlock(nn.Sequential):
    """torchvision.ops.MLP(in_dim, [mlp_dim, in_dim], activation_layer=nn.GELU)."""

    def __init__(self, in_dim: int, mlp_dim: int, dropout: float) -> None:
        super().__init__(
            nn.Linear(in_dim, mlp_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(mlp_dim, in_dim),
            nn.Dropout(dropout),
        )


class EncoderBlock(nn.Module):
    def __init__(self, num_heads: int, hidden_dim: int, mlp_dim: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden_dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(hidden_dim, num_heads, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(hidden_dim, eps=1e-6)
        self.mlp = MLPBlock(hidden_dim, mlp_dim, dropout)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(input)
        x, _ = self.self_attention(query=x, key=x, value=x, need_weights=False)
        x = self.dropout(x) + input
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    def __init__(
        self, seq_length: int, num_layers: int, num_heads: int, hidden_dim: int, mlp_dim: int
    ) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_length, hidden_dim).normal_(std=0.02))
        self.dropout = nn.Dropout(0.0)
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        for i in range(num_layers):
            layers[f"encoder_layer_{i}"] = EncoderBlock(num_heads, hidden_dim, mlp_dim, 0.0)
        self.layers = nn.Sequential(layers)
        self.ln = nn.LayerNorm(hidden_dim, eps=1e-6)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        input = input + self.pos_embedding
        return self.ln(self.layers(self.dropout(input)))


class VisionTransformer(nn.Module):
    def __init__(
        self,
        image_size: int,
        patch_size: int,
        num_layers: int,
        num_heads: int,
        hidden_dim: int,
        mlp_dim: int,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        self.image_size, self.patch_size, self.hidden_dim = image_size, patch_size, hidden_dim
        self.conv_proj = nn.Conv2d(3, hidden_dim, kernel_size=patch_size, stride=patch_size)
        seq_length = (image_size // patch_size) ** 2 + 1
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden_dim))
        self.encoder = Encoder(seq_length, num_layers, num_heads, hidden_dim, mlp_dim)
        self.seq_length = seq_length
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(hidden_dim, num_classes)))

    def _process_input(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        p = self.patch_size
        x = self.conv_proj(x)
        x = x.reshape(n, self.hidden_dim, (h // p) * (w // p))
        return x.permute(0, 2, 1)  # a non-contiguous activation, as torchvision's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._process_input(x)
        batch_class_token = self.class_token.expand(x.shape[0], -1, -1)
        x = torch.cat([batch_class_token, x], dim=1)
        x = self.encoder(x)
        return self.heads(x[:, 0])


def small_vit(num_layers: int = 4) -> VisionTransformer:
    """vit_b_16's shape, small: 32x32 images in 8x8 patches, 2 heads, width 32."""
    return VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=num_layers,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=10,
    )
