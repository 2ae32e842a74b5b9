"""Tensors' private corners: storage identity and version, view bases, subclass instances, the
flash-attention kernel on the CPU and its FLOP count, a DTensor's local chunk, whether the running
backward reaches an autograd node, the mode that sees every operation's tensors (`core.weights`,
`core.measure`, `core.step.chunked_loss`, `plan.profile`, `plan.loss_memory`, the Lightning front).
"""

from __future__ import annotations

from typing import Any

# The mode every operation's dispatch passes through (no public twin in torch 2.13).
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "TorchDispatchMode",
    "flash_attention_backward",
    "flash_attention_lse",
    "fused_attention",
    "fused_attention_flops",
    "local_chunk",
    "make_subclass",
    "storage_identity",
    "tensor_version",
    "view_base",
    "will_backward_reach",
]


def storage_identity(tensor: Any) -> int:
    """An id of the storage under `tensor`, shared by its views, for meta tensors too (whose
    storages have no address)."""
    return tensor.untyped_storage()._cdata


def fused_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    **_: Any,
) -> Any:
    """`scaled_dot_product_attention` through the fused (flash) kernel, which saves the inputs,
    the output and a log-sum-exp row, as fused kernels do on a GPU. On the meta device the public
    function always takes the math path, which saves the whole attention matrix."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0]


def flash_attention_lse(
    query: Any, key: Any, value: Any, is_causal: bool, scale: float | None
) -> tuple[Any, Any]:
    """The CPU flash kernel's output and its log-sum-exp row per query (fp32 for low-precision
    inputs), no dropout and no mask: what merges attention over blocks of keys. Grouped-query
    K/V (fewer heads) are taken as they are."""
    import torch

    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, scale=scale
    )
    return out, lse


def flash_attention_backward(
    grad: Any,
    query: Any,
    key: Any,
    value: Any,
    out: Any,
    lse: Any,
    is_causal: bool,
    scale: float | None,
) -> tuple[Any, Any, Any]:
    """The CPU flash kernel's backward for one block of keys: given the whole attention's `out`
    and `lse` (over every block), the block's share of the query gradient and its keys' and
    values' gradients."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, query, key, value, out, lse, 0.0, is_causal, scale=scale
    )


def is_fused_attention(func: Any) -> bool:
    """Whether `func` (as a `TorchFunctionMode` sees it) is `fused_attention`'s CPU kernel."""
    import torch

    return func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def fused_attention_flops() -> dict[Any, Any]:
    """`FlopCounterMode(custom_mapping=...)` for `fused_attention`'s CPU kernel, which torch's
    counter does not know: the two matmuls of attention (scores, then weighted values)."""
    import torch

    def flops(q: Any, k: Any, v: Any, *_: Any, **__: Any) -> int:
        b, h, s, d = q
        return 2 * b * h * s * k[-2] * d + 2 * b * h * s * k[-2] * v[-1]

    return {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: flops}


def local_chunk(tensor: Any) -> tuple[slice, ...]:
    """Where this rank's part of `tensor` lies in the whole tensor (all of it when it is not a
    DTensor): the index that cuts this rank's rows out of a whole copy."""
    create = getattr(tensor, "__create_chunk_list__", None)  # DTensor's, as DCP reads it
    if create is None:
        return tuple(slice(0, n) for n in tensor.shape)
    (chunk,) = create()
    return tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))


def tensor_version(tensor: Any) -> int:
    """The tensor's version counter (autograd's `_version`): bumped by every in-place write to
    it or to a view of its storage, so comparing two readings tells whether it was written."""
    return tensor._version


def view_base(tensor: Any) -> Any:
    """The tensor `tensor` is a view of (its `_base`), or None when it owns its storage."""
    return tensor._base


def make_subclass(cls: type, data: Any) -> Any:
    """An instance of the tensor subclass `cls` sharing `data`'s storage, without running the
    subclass's `__new__` (`torch.Tensor._make_subclass`, as `nn.Parameter` is built)."""
    import torch

    return torch.Tensor._make_subclass(cls, data)


def will_backward_reach(node: Any) -> bool:
    """Inside a backward pass: whether it runs `node` (a non-leaf autograd node). A split backward
    runs the graph twice, for the input gradients (`autograd.grad` to the inputs) and then for the
    weight gradients (from the saved intermediates to the weights): each pass reaches only its
    own side. A plain `backward()` reaches every node."""
    from torch._C import _will_engine_execute_node

    return bool(_will_engine_execute_node(node))
