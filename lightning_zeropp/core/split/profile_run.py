"""One tallied run of a model on the meta device (`core.split.profile`): the whole model runs
once, shapes only, with hooks around each block that attribute what happens inside it to that
block: the bytes saved for backward (each storage once, weights excluded), the forward FLOPs and
the bytes of each piece's output, for the work before the first block, each block, and the work
after the last. `meta_forward` runs attention as the fused kernels do, so that what they save is
what counts.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_zeropp.core._torch_private import (
    fused_attention,
    fused_attention_flops,
    storage_identity,
)
from lightning_zeropp.core.split.repeats import Repeats

__all__ = ["Tally", "meta_forward", "run_tallied"]


@contextlib.contextmanager
def meta_forward() -> Iterator[None]:
    """Run a model on the meta device as a real run would: attention through the fused kernels
    (`_torch_private.fused_attention`: what they save, not the math path's whole matrix), and
    HF's packed-sequence probe answered "not packed" (it reads values, which meta tensors do not
    have; a batch of input ids alone is never packed)."""
    original = F.scaled_dot_product_attention
    # Ignored: torch's stub types the builtin with positional-only names the stand-in lacks
    F.scaled_dot_product_attention = fused_attention  # type: ignore[assignment]
    masking = sys.modules.get("transformers.masking_utils")
    probe = getattr(masking, "find_packed_sequence_indices", None)
    if probe is not None:
        masking.find_packed_sequence_indices = lambda position_ids: None  # type: ignore[union-attr]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
        if probe is not None:
            masking.find_packed_sequence_indices = probe  # type: ignore[union-attr]


@dataclass
class Tally:
    """Per piece (before, each block, after): saved bytes, FLOPs, output bytes."""

    saved: list[int]
    flops: list[float]
    output: list[int]


def run_tallied(
    model: nn.Module,
    blocks: list[nn.Module],
    rows: int,
    seq_len: int,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    repeats: Repeats | None = None,
    count_flops: bool = True,
) -> Tally:
    """`model` run once on `rows` x `seq_len` zero token ids (meta device) and `loss_fn` on its
    logits, tallied per piece; `repeats` credits blocks not run again (`core.split.repeats`)."""
    n = len(blocks)
    tally = Tally([0] * (n + 2), [0.0] * (n + 2), [0] * (n + 2))
    piece = [0]  # 0: before the blocks; i + 1: inside block i; n + 1: after them
    params = {storage_identity(p) for p in model.parameters()}
    seen: set[int] = set()
    counter = FlopCounterMode(display=False, custom_mapping=fused_attention_flops())
    flops_at = [0.0]

    def move_to(index: int) -> None:
        total = float(counter.get_total_flops()) if count_flops else 0.0
        tally.flops[piece[0]] += total - flops_at[0]
        flops_at[0] = total
        piece[0] = index

    def enter(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if i == 0:
                tally.output[0] = _nbytes(args)  # the first block's input: the embeddings
            move_to(i + 1)

        return hook

    if repeats is not None:
        repeats.reset()

    def leave(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            tally.output[i + 1] = _nbytes(output)
            move_to(n + 1)  # until the next block starts, work belongs after the blocks
            if repeats is not None:
                repeats.credit(i, tally.saved, tally.flops, output)

        return hook

    def pack(t: torch.Tensor) -> Any:
        key = storage_identity(t)
        if key not in params and key not in seen:
            seen.add(key)
            tally.saved[piece[0]] += t.untyped_storage().nbytes()
        return t

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(enter(i)))
        handles.append(block.register_forward_hook(leave(i)))
    tokens = torch.zeros(rows, seq_len, dtype=torch.long, device="meta")
    try:
        with (
            # what a training step saves, even where the caller runs without gradients
            torch.enable_grad(),
            counter if count_flops else contextlib.nullcontext(),
            meta_forward(),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            out = model(tokens)
            logits = getattr(out, "logits", out)
            tally.output[n + 1] = _nbytes(logits)
            loss_fn(logits, tokens)
            move_to(n + 1)
    finally:
        for handle in handles:
            handle.remove()
    return tally


def _nbytes(value: Any) -> int:
    """Bytes of the first tensor in `value` (a block's hidden state comes first)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)) and value:
        return _nbytes(value[0])
    return 0
