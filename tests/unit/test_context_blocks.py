"""Context parallelism's maskless attention (`core.step.context_blocks`) on a one-rank gloo group:
the causal (or unmasked) attention of a rank's two chunks, computed per block of keys and merged
by log-sum-exp, equals torch's own attention over the whole sequence, forward and backward; and
it keeps no mask and no gathered K/V for the backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_zeropp.core.step.context import ContextSplit
from lightning_zeropp.core.step.context_attention import ContextAttention
from lightning_zeropp.core.step.context_blocks import block_attention, key_blocks

pytestmark = pytest.mark.usefixtures("group")


class _Ids(nn.Module):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids


def _inputs(dtype: torch.dtype, heads: int, kv_heads: int, length: int = 24):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, length, 8, generator=g).to(dtype).requires_grad_()
    k = torch.randn(2, kv_heads, length, 8, generator=g).to(dtype).requires_grad_()
    v = torch.randn(2, kv_heads, length, 8, generator=g).to(dtype).requires_grad_()
    return q, k, v


def _run(fn, q, k, v):
    out = fn(q, k, v)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "causal", "tol"),
    [
        (torch.float32, 4, 4, True, 2e-6),
        (torch.float32, 4, 2, True, 2e-6),  # grouped-query: K/V heads only
        (torch.float32, 2, 2, False, 2e-6),
        (torch.bfloat16, 4, 2, True, 3e-2),
    ],
)
def test_blocks_merged_by_log_sum_exp_equal_whole_attention(dtype, heads, kv_heads, causal, tol):
    # one rank holds chunks 0 and 1 of 2: chunk 1's queries take a block before and their own
    order = torch.arange(24)
    ours = _run(
        lambda q, k, v: block_attention(q, k, v, dist.group.WORLD, order, (0, 1), causal, None),
        *_inputs(dtype, heads, kv_heads),
    )
    theirs = _run(
        lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=heads != kv_heads
        ),
        *_inputs(dtype, heads, kv_heads),
    )
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def test_a_later_chunk_sees_every_earlier_key_and_its_own_causally():
    assert key_blocks(0, 4, 32, True) == [(0, 4, True)]
    assert key_blocks(5, 4, 32, True) == [(0, 20, False), (20, 24, True)]
    assert key_blocks(5, 4, 32, False) == [(0, 32, False)]


def test_a_plain_causal_call_keeps_no_mask_and_no_gathered_keys():
    # the masked path saves a (local queries x all keys) mask per micro-batch and the gathered
    # K/V per call; this one saves the call's own tensors and the output's log-sum-exp
    split = ContextSplit(1, 0, _Ids())
    split.set_length(24)
    attention = ContextAttention(split, dist.group.WORLD)
    q, k, v = _inputs(torch.float32, 2, 2)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = attention.attention(q, k, v, is_causal=True)
    assert attention._last is None  # no mask made
    assert sorted((t.shape for t in saved), key=len) == [(2, 2, 24), *[q.shape] * 4]
    # the call's own K and V (one rank here: gathered ones would have the same shapes)
    ids = {t.untyped_storage().data_ptr() for t in saved}
    assert {k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()} <= ids
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    # a mask of the model's own still takes the masked path
    own = torch.ones(24, 24, dtype=torch.bool).tril()
    own[1:, 1] = False  # key 1 a pad
    attention.attention(q, k, v, attn_mask=own)
    assert attention._last is not None


@pytest.mark.parametrize(
    ("shapes", "gqa", "blocks"),
    [
        (((2, 4, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4)), True, True),
        (((2, 4, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4)), False, False),  # torch's raises: masked
        (((2, 3, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4)), True, False),
        (((2, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4)), False, False),  # K/V broadcast over rows
        (((2, 2, 8, 4), (2, 2, 8, 4), (2, 2, 8, 6)), False, False),  # V's head size differs
        (((2, 8, 4), (2, 8, 4), (2, 8, 4)), False, False),  # 3-D
    ],
)
def test_calls_the_kernel_cannot_take_keep_the_masked_path(shapes, gqa, blocks):
    from lightning_zeropp.core.step.context_blocks import blocks_apply

    q, k, v = (torch.zeros(s) for s in shapes)
    assert blocks_apply(q, k, v, None, 0.0, gqa) is blocks
    assert not blocks_apply(q, k, v, torch.ones(8, 8, dtype=torch.bool), 0.0, gqa)
    assert not blocks_apply(q, k, v, None, 0.1, gqa)


def test_a_recomputation_inside_the_step_keeps_the_steps_mask():
    # the engine enters the mode for a step, and torch's checkpoint again for each block's
    # recomputation: leaving the inner one keeps the micro-batch's mask, the outer one drops it
    split = ContextSplit(1, 0, _Ids())
    split.set_length(8)
    attention = ContextAttention(split, dist.group.WORLD)
    query = torch.zeros(1, 2, 8, 3)
    with attention:
        mask = attention._mask(None, True, query)
        with attention:
            assert attention._mask(None, True, query) is mask
        assert attention._last is not None and attention._mask(None, True, query) is mask
    assert attention._last is None


def test_a_checkpointed_block_recomputes_under_the_mode_it_is_given():
    # torch's checkpoint does not carry a function mode into the recomputation (the backward
    # starts with none): without `recompute_under` the recomputed attention call is not seen
    from torch.overrides import TorchFunctionMode

    from lightning_zeropp.core.shard.fsdp import apply_activation_checkpointing

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention:
                type(self).calls += 1
            return func(*args, **(kwargs or {}))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.proj(x)
            return F.scaled_dot_product_attention(h, h, h, is_causal=True)

    for given, expected in ((False, 1), (True, 2)):
        stage, mode = nn.Sequential(Block()), Counting()
        Counting.calls = 0
        apply_activation_checkpointing(stage, ["0"], mode if given else None)
        with mode:
            stage(torch.randn(1, 2, 8, 4, requires_grad=True)).sum().backward()
        assert Counting.calls == expected
