"""What the head and the loss hold on the last stage only while they run, priced on the meta device.

Saved-tensor tracking (`plan.profile`, the memory report) counts what a micro-batch keeps from its
forward to its backward. The head and the loss also hold memory only while they run, which it
does not see and which, with today's vocabularies, is of the size of everything a block saves:
- in the forward, the logits in the model's dtype and in fp32 while the cross-entropy runs
  (whole logits), or one chunk's (`core.step.chunked_loss`);
- in the backward, the logits' gradient in fp32 and in the model's dtype (whole logits: 3.9 GiB
  above what the loss saved for Llama-3-8B's head at 4096 tokens in bf16), or one chunk's logits
  and their gradient plus, in bf16, the fp32 sum of the head's weight gradient (chunks).

`loss_transients` runs the loss as the run computes it (`linear_cross_entropy` in chunks, or
`F.cross_entropy` over fp32 logits) on the meta device, forward and backward, with every storage
an operation creates tracked until it is freed (`LiveBytes`). What the forward leaves is the
loss's saved bytes (counted by the profile already); the figures are what each pass holds above
that at its busiest. Gradients that outlive the backward (the head's, which FSDP reduces: priced
by `plan.peaks.gradient_buffers`; the hidden states', sent to the previous stage) are left out.
The elementwise passes of a whole-logits loss written otherwise (HF's `ForCausalLMLoss` shifts
the labels, not the logits) allocate alike; a loss the planner cannot see is not priced.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zeropp.core._torch_private import TorchDispatchMode, storage_identity, tree_flatten
from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.step.chunked_loss import linear_cross_entropy
from lightning_zeropp.plan.loss_chunk import chunked_head, priced_chunk

__all__ = [
    "LiveBytes",
    "head_weight",
    "held_weight_gradient",
    "last_stage_transients",
    "loss_transients",
]


class LiveBytes(TorchDispatchMode):
    """Every storage an operation creates while the mode is on, from its creation to its release:
    `events` are (allocation, +bytes) and (allocation, -bytes) in order; `live` is their sum."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []
        self.live = 0
        self._alive: dict[int, int] = {}  # storage id -> allocation, while the storage lives

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inputs = tree_flatten((args, kwargs))[0]
        # a view of an input, or an operation that wrote into one, allocates nothing
        given = {storage_identity(t) for t in inputs if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and storage_identity(value) not in given:
                self._track(value)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage, key = tensor.untyped_storage(), storage_identity(tensor)
        if key in self._alive:  # a second output on one storage
            return
        allocation, size = len(self.events), storage.nbytes()
        self._alive[key] = allocation
        self.events.append((allocation, size))
        self.live += size
        weakref.finalize(storage, self._free, key, allocation, size)

    def _free(self, key: int, allocation: int, size: int) -> None:
        self._alive.pop(key, None)
        self.events.append((allocation, -size))
        self.live -= size

    def surviving(self) -> set[int]:
        """The allocations not released yet."""
        return set(self._alive.values())

    def allocations(self, tensor: torch.Tensor | None) -> set[int]:
        """The allocation under `tensor`, if this mode made it and it lives."""
        if tensor is None or storage_identity(tensor) not in self._alive:
            return set()
        return {self._alive[storage_identity(tensor)]}

    def peak(self, start: int = 0, leave_out: set[int] | None = None) -> int:
        """The most bytes live at once from event `start` on, leaving out `leave_out`'s
        allocations."""
        skip = leave_out or set()
        live = sum(size for key, size in self.events[:start] if key not in skip)
        most = live
        for key, size in self.events[start:]:
            if key not in skip:
                live += size
                most = max(most, live)
        return most


def head_weight(model: nn.Module) -> torch.Tensor | None:
    """The weight of `model`'s head over the vocabulary: the one the runtime chunks, or an HF
    model's output embedding; None where the planner cannot tell it."""
    name = chunked_head(model)
    if name is not None:
        return model.get_submodule(name).get_parameter("weight")
    outputs = getattr(model, "get_output_embeddings", None)
    head = outputs() if callable(outputs) else None
    weight = getattr(head, "weight", None)
    return weight if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def loss_transients(
    model: nn.Module, tokens: int, dtype: torch.dtype | None, chunk: int
) -> tuple[int, int]:
    """Bytes the head and the loss of a micro-batch of `tokens` hold above what the loss saves,
    at their busiest in the forward and in the backward ((0, 0) where the head is not known);
    `dtype`: the run's compute dtype (None: the weights'); `chunk`: `loss_chunk` (0: whole)."""
    weight = head_weight(model)
    if weight is None:
        return 0, 0
    vocab, dim = weight.shape
    return _transients(vocab, dim, tokens, dtype or weight.dtype, chunk, weight.requires_grad)


def held_weight_gradient(model: nn.Module, config: ZeroPPLayout, rows: int, seq_len: int) -> int:
    """Bytes the chunked loss holds from a micro-batch's input-gradient pass to its weight pass
    under a split backward: the head's weight gradient, computed in the input pass and kept for
    the weight pass (`core.step.chunked_loss`), in the run's compute dtype; 0 where the run does
    not chunk or the head is frozen."""
    weight = head_weight(model)
    if weight is None or not weight.requires_grad or not priced_chunk(model, config, rows, seq_len):
        return 0
    return weight.numel() * (config.param_dtype or weight.dtype).itemsize


def last_stage_transients(
    model: nn.Module, config: ZeroPPLayout, rows: int, seq_len: int
) -> tuple[int, int]:
    """`loss_transients` of a micro-batch of `rows` x `seq_len` tokens in the run of `config` (a
    resolved config): in chunks where the runtime chunks (`plan.loss_chunk.priced_chunk`), else
    whole logits; whole sequences under context parallelism, as the fronts gather them."""
    chunk = priced_chunk(model, config, rows, seq_len)
    return loss_transients(model, rows * seq_len, config.param_dtype, chunk)


@functools.lru_cache(maxsize=256)
def _transients(
    vocab: int, dim: int, tokens: int, dtype: torch.dtype, chunk: int, trained: bool
) -> tuple[int, int]:
    hidden = torch.empty(tokens, dim, device="meta", dtype=dtype, requires_grad=True)
    weight = torch.empty(vocab, dim, device="meta", dtype=dtype, requires_grad=trained)
    target = torch.zeros(tokens, dtype=torch.long, device="meta")
    with torch.enable_grad(), LiveBytes() as track:  # a training step's, whatever the caller's
        loss = _forward(hidden, weight, target, chunk)
        forward_peak, saved, mark = track.peak(0), track.live, len(track.events)
        loss.backward()
        # What outlives the backward is not transient: the hidden states' gradient (sent to the
        # previous stage) and the loss. The weight's is: from the second micro-batch of a step
        # on, it is added into the gradient FSDP holds (`plan.peaks.gradient_buffers`) and freed.
        kept = track.surviving() - track.allocations(weight.grad)
        backward_peak = track.peak(mark, kept)
    return forward_peak - saved, max(0, backward_peak - saved)


def _forward(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk: int
) -> torch.Tensor:
    """The summed loss as the run computes it: in chunks, or from whole fp32 logits."""
    if 0 < chunk < hidden.shape[0]:
        return linear_cross_entropy(hidden, weight, None, target, chunk=chunk)
    # the logits stay referenced while the loss runs, as a model's output holds them (HF's
    # `ForCausalLMLoss` upcasts them inside the loss)
    logits = F.linear(hidden, weight)
    loss = F.cross_entropy(logits.float(), target, reduction="sum")
    del logits
    return loss


def _run(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk: int) -> None:
    """`_forward` and its backward (the tests' real runs)."""
    _forward(hidden, weight, target, chunk).backward()
