"""Dense tensors at stage boundaries: gloo's point-to-point ops send and receive contiguous tensors
only ("input tensor has to be contiguous"), and a pipeline's receive buffers copy the layout of
what shape inference saw. Activations leaving a stage and gradients flowing back into the previous
one are made contiguous (a copy only when they are not: a permuted patch embedding, attention
that transposes its input).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_zeropp.core._torch_private import tree_map

__all__ = ["dense_boundaries", "dense_grad"]


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (nn.MultiheadAttention with
    batch_first yields a transposed input gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def dense_grad(x: Any) -> Any:
    """`x`, whose gradient will be contiguous (non-tensors and tensors without grad as they are)."""
    if isinstance(x, torch.Tensor) and x.requires_grad:
        return _DenseGrad.apply(x)
    return x


def _dense(x: Any) -> Any:
    return x.contiguous() if isinstance(x, torch.Tensor) else x


def dense_boundaries(stage: nn.Module, first: bool, last: bool) -> None:
    """Hooks on a stage module (traced, stacked or a user's) so that what it sends (outputs unless
    it is the last stage) and the gradients it sends back (of its positional inputs unless it is
    the first) are contiguous."""
    if not first:
        stage.register_forward_pre_hook(lambda _m, args: tree_map(dense_grad, args))
    if not last:
        stage.register_forward_hook(lambda _m, _args, out: tree_map(_dense, out))
