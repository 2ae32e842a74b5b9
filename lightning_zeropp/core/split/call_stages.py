"""The stage modules of `split="call"`: copies of the model cut at block calls (see `call_plan`).

A stage is a copy of the model whose blocks and outer modules held by other stages are `Stub`s
(`stubs`)
(so parameter names, indexing and attribute reads are as in the model), and whose `forward` runs the model's own forward on the model
inputs of the micro-batch (keyword arguments `zeropp_in_<i>`, see `CallInputs`) after the
activations received from the previous stage (positional). Hooks on its first and last block swap
in what was received and keep what is to be sent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_zeropp.core._torch_private import tree_flatten, tree_unflatten
from lightning_zeropp.core.split.call_plan import CallInputs, CallPlan
from lightning_zeropp.core.split.copies import meta_copy, stage_copy
from lightning_zeropp.core.split.dense import dense_grad
from lightning_zeropp.core.split.outputs import OUTPUTS_ATTR, Outputs
from lightning_zeropp.core.split.stubs import Stub, stand_in_parameter

__all__ = ["build_call_stages"]


_CHECKPOINT_FIX = (
    "To checkpoint blocks, drop the call-site checkpoint and pass activation_checkpointing=True "
    "(every block; or 'except_last'), or call torch.utils.checkpoint.checkpoint(block, ..., "
    "use_reentrant=False)."
)
_NO_GRAD_BLOCK = (
    "pipeline stage {stage}: a block was called with gradients off inside a training forward "
    "(torch.utils.checkpoint(..., use_reentrant=True) runs it so, or torch.no_grad()): under "
    "split='call' its input is what the previous stage sent, so that would silently drop its "
    "gradients and those of every earlier stage. " + _CHECKPOINT_FIX
)


def _memory(t: Any) -> tuple[int, ...] | None:
    """Where a tensor's values live (None for no tensor, or one with no memory)."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return None
    return (t.data_ptr(), *t.shape, *t.stride())


class _StageState:
    """What one call stage keeps between its hooks during a forward."""

    def __init__(self, plan: CallPlan, stage: int, inputs: CallInputs) -> None:
        self.plan, self.stage, self.inputs = plan, stage, inputs
        self.is_last = stage == len(plan.blocks.ranges) - 1
        self.received: tuple[torch.Tensor, ...] | None = None
        # The extras (`CallPlan.aux`) of the blocks before this stage's, received, and those of
        # this stage's blocks, kept as they return.
        self.got_aux: tuple[torch.Tensor, ...] | None = None
        self.own_aux: dict[int, tuple[torch.Tensor, ...]] = {}
        self.sent: tuple[torch.Tensor, ...] | None = None
        self.forward: Callable[..., Any] | None = None
        self.outputs = Outputs()
        self.running = False  # inside `run` (a block called outside it is being recomputed)
        self.training = False  # `run` began with gradients on
        self.swapped: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}  # see `_swap`

    def _forget(self, key: tuple[int, ...], grad: torch.Tensor) -> None:
        self.swapped.pop(key, None)  # its backward is done: no recompute will ask for it

    def entry(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        """The first block's arguments: its tensors are what the previous stage sent."""
        return self._swap(args, kwargs, self.plan.slots, self.received)

    def inner(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        """A later block's arguments: the hidden state is its own; the other tensors computed
        from outer modules (an encoder's memory) are what the previous stage sent, since this
        stage's forward computed them from stubs; those computed from the model inputs alone (a
        mask, rotary tables) are this stage's own (`CallPlan.local`)."""
        return self._swap(args, kwargs, self.plan.slots[1:], self.received, 1)

    def _swap(self, args: Any, kwargs: Any, slots: Any, received: Any, skip: int = 0) -> Any:
        # Non-tensor arguments (a sequence length, a flag) are the call's own: this stage's
        # forward computed them from the real inputs of this batch.
        leaves, spec = tree_flatten((args, kwargs))
        if spec != self.plan.spec:
            raise RuntimeError(
                f"pipeline stage {self.stage}: a block was called with arguments of another "
                "structure than when the split was checked; split='call' needs the same call."
            )
        if not slots:
            return args, kwargs
        # A block checkpointed at the model's call site (`checkpoint(block, h)`) is called again
        # in backward with the placeholder its forward got (a fresh tensor per call, kept by
        # the checkpoint, unpacked as another Python object over the same memory): it must get
        # the values of that forward, not those of the micro-batch this stage ran last. They
        # are kept by the placeholder's memory until their gradient is computed.
        key = _memory(leaves[slots[0]])
        if self.running:
            assert received is not None
            if self.training and not torch.is_grad_enabled():
                raise RuntimeError(_NO_GRAD_BLOCK.format(stage=self.stage))
            values = received[skip:]
            if key is not None and torch.is_grad_enabled() and values[0].requires_grad:
                self.swapped[key] = values
                values[0].register_hook(functools.partial(self._forget, key))
        else:  # recomputed in backward: the values this call had in its forward
            values = self.swapped.get(key) if key is not None else None
            if values is None:
                raise RuntimeError(
                    f"pipeline stage {self.stage}: a block was called again outside the "
                    "model's forward (recomputed in backward) with inputs its forward did not "
                    "have; split='call' cannot give it this stage's received activations. "
                    + _CHECKPOINT_FIX
                )
        for slot, value in zip(slots, values, strict=True):
            leaves[slot] = value
        return tree_unflatten(leaves, spec)

    def keep_aux(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if not self.running:  # a recompute in backward: already sent
                return
            kept = tuple(out[j] for j in self.plan.aux)
            odd = [j for j, t in zip(self.plan.aux, kept, strict=True) if not torch.is_tensor(t)]
            if odd:
                raise RuntimeError(
                    f"pipeline stage {self.stage}: block {index} returned "
                    f"{type(out[odd[0]]).__name__} at position {odd[0]} of its return, a tensor "
                    "(an auxiliary loss) read after the blocks when split='call' checked the "
                    "model; the next stage needs it. Return a tensor for every batch."
                )
            self.own_aux[index] = kept

        return hook

    def exit(self, module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        """Keep what the next stage needs: this block's output and the other block arguments."""
        leaves, _ = tree_flatten((args, kwargs))
        hidden = out if self.plan.out_index is None else out[self.plan.out_index]
        self.sent = (hidden, *(leaves[slot] for slot in self.plan.slots[1:]))
        for slot, value in zip(self.plan.slots, self.sent, strict=True):
            if not isinstance(value, torch.Tensor):
                raise RuntimeError(
                    f"pipeline stage {self.stage}: block argument {slot} (in the order "
                    "torch.utils._pytree flattens (args, kwargs)) was a tensor computed from an "
                    f"outer module when split='call' checked the model and is {value!r} for this "
                    "batch; the next stage needs it. Keep that argument a tensor for every batch."
                )

    def run(self, *received: torch.Tensor, **flat_inputs: Any) -> Any:
        args, kwargs = self.inputs.unflatten(flat_inputs)
        received = tuple(dense_grad(t) for t in received)
        ours = len(self.plan.slots)
        self.received, self.sent = (received[:ours] if self.stage > 0 else None), None
        self.got_aux = received[ours:] if self.stage > 0 else None
        self.own_aux = {}
        self.running, self.training = True, torch.is_grad_enabled()
        try:
            assert self.forward is not None
            out = self.forward(*args, **kwargs)
            extras = (*(self.got_aux or ()), *_flat(self.own_aux))
        finally:
            self.received, self.running, self.got_aux, self.own_aux = None, False, None, {}
        if self.is_last:
            return self.outputs.flat(out)
        sent, self.sent = self.sent, None
        if sent is None:
            raise RuntimeError(
                f"pipeline stage {self.stage}'s last block was not called by the model's forward "
                "for this batch; split='call' needs every block called for every batch."
            )
        # Sent tensors must be dense: the receiver's buffers copy their layout, and gloo's
        # point-to-point ops take contiguous tensors only (e.g. a rotary table sliced per batch).
        return tuple(t.contiguous() for t in (*sent, *extras))


def _flat(kept: dict[int, tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    return tuple(t for i in sorted(kept) for t in kept[i])


def build_call_stages(
    model: nn.Module,
    plan: CallPlan,
    stage_ids: Sequence[int],
    inputs: CallInputs,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> list[nn.Module]:
    """This rank's stage modules of `model` under `plan`; `dtype` is the compute dtype of the
    parameters when it is not theirs (FSDP2 mixed precision)."""
    return [_call_stage(model, plan, s, inputs, device, dtype) for s in stage_ids]


def _call_stage(
    model: nn.Module,
    plan: CallPlan,
    stage: int,
    inputs: CallInputs,
    device: torch.device,
    dtype: torch.dtype | None,
) -> nn.Module:
    blocks = plan.blocks
    first, last = stage == 0, stage == len(blocks.ranges) - 1
    # Copy everything but the modules of other stages (never materialized twice): stubs instead.
    memo: dict[int, Any] = {}
    for i, _ in enumerate(blocks.names):
        if i not in blocks.ranges[stage]:
            block = model.get_submodule(blocks.fqn(i))
            memo[id(block)] = Stub(meta_copy(block), blocks.fqn(i), device, block=plan)
    away = [*(() if first else plan.first_units), *(() if last else plan.last_units)]
    for name in away:
        unit = model.get_submodule(name)
        memo[id(unit)] = Stub(meta_copy(unit), name, device, dtype=dtype)
    elsewhere = [
        *(() if first else plan.first_params),
        *(() if last else plan.last_params),
    ]
    for name in elsewhere:  # not copied: a stand-in replaces it below
        p = model.get_parameter(name)
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    stage_model = stage_copy(model, memo)
    for name in elsewhere:
        stand_in_parameter(stage_model, name, device, dtype)
    state = _StageState(plan, stage, inputs)
    mine = [stage_model.get_submodule(blocks.fqn(i)) for i in blocks.ranges[stage]]
    if not first:
        mine[0].register_forward_pre_hook(state.entry, with_kwargs=True)
        for block in mine[1:]:
            block.register_forward_pre_hook(state.inner, with_kwargs=True)
    if not last:
        mine[-1].register_forward_hook(state.exit, with_kwargs=True)
        if plan.aux:
            for i, block in zip(blocks.ranges[stage], mine, strict=True):
                block.register_forward_hook(state.keep_aux(i))
    if plan.aux:
        for i, _ in enumerate(blocks.names):
            if i not in blocks.ranges[stage]:
                stub = stage_model.get_submodule(blocks.fqn(i))
                object.__setattr__(stub, "_index", i)
                object.__setattr__(stub, "_state", state)
    state.forward = functools.partial(type(model).forward, stage_model)
    object.__setattr__(stage_model, "_zeropp_call_stage", state)
    object.__setattr__(stage_model, OUTPUTS_ATTR, state.outputs)
    stage_model.forward = state.run
    return stage_model
