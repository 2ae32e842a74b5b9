"""`split="call"`: pipeline stages that run the model's own forward, cut at its block calls.

No graph capture (so no torch.export limits, and any batch shape): each stage module is a copy of
the model holding only its own blocks plus, on the first and last stage, the modules the forward
calls before and after the blocks. Its forward is the model's own, run on the real model inputs
(the engine gives every stage the micro-batch's inputs: all ranks of a pipeline hold the batch):
- blocks of other stages are stubs that return their input hidden state (cheap pass-through);
- outer modules of other stages are stubs returning zeros shaped like their real output (computed
  on a meta-device copy), so the code around them runs; what that code computes is discarded;
- a stub answers attribute reads from its meta-device copy (`self.layers[0].self_attn.batch_first`);
- on stage k > 0 the first block's arguments are replaced by those stage k-1 sent, except those
  computed from the model inputs alone (masks, position tables), which every stage computes;
- on stage k < last the forward runs on (the rest is stubs) and the stage returns its last
  block's output and the other block arguments instead of the model's output.

That is exact for models whose blocks form a chain: each block is called once, in order, with the
previous block's output and otherwise the same arguments, and nothing computed before or between
the blocks is read after them except through that chain. `plan_calls` checks it once, on a
meta-device copy with one example micro-batch, by tagging every value with where it came from, and
refuses a model that breaks it, naming the module or value at fault.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_zeropp.core._torch_private import TreeSpec, tree_flatten, tree_map, tree_unflatten
from lightning_zeropp.core.split.blocks import BlockPlan
from lightning_zeropp.core.split.call_run import (
    FIX,
    BlockCall,
    DryRun,
    DryRunFailed,
    dry_run,
    outer_parts,
)
from lightning_zeropp.core.split.copies import meta_copy

__all__ = ["CallPlan", "CallInputs", "plan_calls", "meta_copy", "outer_parts"]


@dataclass(frozen=True)
class CallPlan:
    """Where each module runs and how a block's arguments cross a stage boundary."""

    blocks: BlockPlan
    first_units: tuple[str, ...]  # outer modules with parameters, called before the blocks
    last_units: tuple[str, ...]  # ... called after them
    spec: TreeSpec  # of a block call's (args, kwargs)
    slots: tuple[int, ...]  # the tensor leaves sent on: the hidden state first, then the others
    local: tuple[int, ...]  # tensor leaves each stage computes itself from the model inputs
    out_index: int | None  # where that output sits in a block's return value (None: it is it)
    out_len: int  # the length of a block's return value when it is a tuple
    # Parameters held outside any submodule (a position table, ViT's cls_token, CLIP's
    # logit_scale), by the model or a module on the path to the blocks: with the stage whose
    # code reads them, the first when read before the blocks (or never), the last when after.
    first_params: tuple[str, ...] = ()
    last_params: tuple[str, ...] = ()
    # Positions in a block's tuple return of the extra tensors the forward reads after the
    # blocks (a mixture-of-experts auxiliary loss summed over the blocks): each stage sends
    # those of every block up to its last along with the hidden state, and on a later stage the
    # stand-in of an earlier block returns what it received (`call_stages`).
    aux: tuple[int, ...] = ()


class CallInputs:
    """The model inputs of the current step, shared by the engine and its call stages: the engine
    passes their leaves as keyword arguments `zeropp_in_<i>` (split into micro-batches by the
    schedule, given to every stage) and `spec` rebuilds the model call from them."""

    PREFIX = "zeropp_in_"

    def __init__(self) -> None:
        self.spec: TreeSpec | None = None

    def flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        leaves, self.spec = tree_flatten((tuple(args), dict(kwargs)))
        return {f"{self.PREFIX}{i}": leaf for i, leaf in enumerate(leaves)}

    def unflatten(self, flat: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        assert self.spec is not None, "the engine sets the input spec before every step"
        leaves = [flat[f"{self.PREFIX}{i}"] for i in range(len(flat))]
        return tree_unflatten(leaves, self.spec)


def _to_meta(x: Any) -> Any:
    return torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x


# ------------------------------------------------------------------------------ the dry run
def plan_calls(
    model: nn.Module,
    blocks: BlockPlan,
    example_args: tuple[Any, ...] | None,
    example_kwargs: dict[str, Any] | None,
) -> CallPlan:
    """Check on the meta device that `model` pipelines exactly under split='call'; plan it."""
    if example_args is None and not example_kwargs:
        raise ValueError(
            "split='call' needs one example micro-batch of model inputs to check the model's calls "
            "(the Lightning front takes it from the first batch)."
        )
    example = (tuple(example_args or ()), dict(example_kwargs or {}))
    try:  # on the meta device first: no memory, no compute
        return _plan(
            dry_run(meta_copy(model), blocks, tree_map(_to_meta, example), model), blocks, model
        )
    except DryRunFailed as meta_err:
        real = all(not t.is_meta for t in tree_flatten(example)[0] if isinstance(t, torch.Tensor))
        if not real:
            raise ValueError(str(meta_err)) from meta_err.__cause__
        if any(p.is_meta for p in model.parameters()):
            # A model built on the meta device has no values to run: keep the example real so
            # that values computed from the inputs alone can be read, and everything the
            # weights touch becomes meta.
            try:
                return _plan(
                    dry_run(meta_copy(model), blocks, example, model, mixed=True), blocks, model
                )
            except DryRunFailed as err:
                raise ValueError(str(err)) from err.__cause__
    # Some forwards read values (`.item()`, `torch.equal`) that meta tensors do not have: check on
    # the real model and example once, without gradients, where the weights are (the example
    # comes from the loader, in host memory, while a model built under `torch.device("cuda")` or
    # loaded with a `device_map` already sits on the accelerator).
    with torch.no_grad():
        try:
            return _plan(
                dry_run(model, blocks, _where_weights_are(model, example), model), blocks, model
            )
        except DryRunFailed as err:
            raise ValueError(str(err)) from err.__cause__


def _where_weights_are(model: nn.Module, example: Any) -> Any:
    """`example` with its tensors moved to the device holding all of `model`'s weights (as is
    where they lie on several devices)."""
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if len(devices) != 1:
        return example
    (device,) = devices
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, example)


def _plan(run: DryRun, blocks: BlockPlan, model: nn.Module) -> CallPlan:
    """The plan from the dry run's record, or a refusal naming what breaks the chain."""
    units, calls, events, tagger = run.units, run.calls, run.events, run.tagger
    model_name, leak = type(model).__name__, tagger.leak

    def refuse(why: str) -> ValueError:
        return ValueError(f"split='call' cannot pipeline {model_name}: {why}; {FIX}.")

    if [c.block for c in calls] != list(range(len(blocks.names))):
        raise refuse(
            f"its forward must call each block of '{blocks.container}' once, in order (it called "
            f"{[blocks.names[c.block] for c in calls]})"
        )
    if leak is not None:
        raise refuse(leak)
    first_block = events.index(("block", 0))
    last_block = events.index(("block", len(blocks.names) - 1))
    first, last = [], []
    for name in units:
        where = {i for i, e in enumerate(events) if e == ("unit", name)}
        if where and max(where) < first_block:
            first.append(name)
        elif where and min(where) > last_block:
            last.append(name)
        elif where:
            raise refuse(f"module '{name}' is called between or both before and after the blocks")
        else:
            first.append(name)  # never called: it holds parameters, keep them somewhere
    first_params, last_params = _place_bare(tagger.bare_reads, refuse)
    leaves, spec = tree_flatten((calls[0].args, calls[0].kwargs))
    hidden, out_index = _chain(calls, leaves, spec, refuse)
    aux = _extras(calls, tagger.read_after, out_index, refuse)
    others = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and i != hidden]
    # A block argument computed from the model inputs alone (a padding mask, position ids and
    # rotary tables, a constant) is the same on every stage, which holds the micro-batch: each
    # stage computes its own, so it may also be None for some batches (HF builds no mask for an
    # unpadded one). One that depends on an outer module's output or on a random draw is sent.
    sources = calls[0].sources
    local = tuple(i for i in others if not sources[i])
    slots = (hidden, *(i for i in others if sources[i]))
    out = calls[0].out
    out_len = 1 if isinstance(out, torch.Tensor) else len(out)
    return CallPlan(
        blocks,
        tuple(first),
        tuple(last),
        spec,
        slots,
        local,
        out_index,
        out_len,
        first_params,
        last_params,
        aux,
    )


def _extras(
    calls: list[BlockCall], read: set[Any], out_index: int | None, refuse: Callable
) -> tuple[int, ...]:
    """The positions of the extra values of a block's return read after the blocks: any part
    but an earlier block's hidden state (which the next block took) may be; each must be a
    tensor from every block (a stage sends them on)."""
    last = len(calls) - 1
    for _, (block, j) in sorted(read):
        if j == out_index and block != last:
            raise refuse(
                f"after the last block reads a value computed from block {block}'s output other "
                "than through the blocks' arguments"
            )
    aux = tuple(sorted({j for _, (_, j) in read if j != out_index}))
    for call in calls:
        odd = [j for j in aux if not isinstance(call.out[j], torch.Tensor)]
        if odd:
            raise refuse(
                f"block {call.block} returns {type(call.out[odd[0]]).__name__} at position {odd[0]} of its "
                "return, which the forward reads after the blocks; each block's extra return "
                "values (an auxiliary loss) must be tensors for split='call' to send them on"
            )
    return aux


def _place_bare(
    reads: dict[str, set[str]], refuse: Callable[[str], ValueError]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The stage of each parameter held outside any submodule, from where the forward read it."""
    first, last = list[str](), list[str]()
    for name, where in reads.items():
        if "between" in where or where == {"before", "after"}:
            raise refuse(
                f"its forward reads parameter '{name}' (held outside any submodule) "
                f"{' and '.join(w for w in ('before', 'between', 'after') if w in where)} the blocks; a parameter goes with the one stage "
                "whose code reads it: read it only before the blocks or only after them (or put "
                "it in a module called there)"
            )
        (last if where == {"after"} else first).append(name)
    return tuple(first), tuple(last)


def _chain(calls: list[BlockCall], leaves: list[Any], spec: TreeSpec, refuse: Callable) -> Any:
    """Which leaf carries the previous block's output, and where that output sits in a return."""
    found: tuple[int, int | None] | None = None
    for call, then in zip(calls, calls[1:], strict=False):
        out, src0, src1 = call.out, call.sources, then.sources
        prev, spec0 = tree_flatten((call.args, call.kwargs))
        now, spec1 = tree_flatten((then.args, then.kwargs))
        outs = [out] if isinstance(out, torch.Tensor) else list(out)
        picks = [
            (p, None if isinstance(out, torch.Tensor) else j)
            for p, x in enumerate(now)
            for j, o in enumerate(outs)
            if x is o
        ]
        if spec1 != spec0 or len(picks) != 1 or (found is not None and picks[0] != found):
            raise refuse("each block must take the previous block's output as one argument")
        found = picks[0]
        for p, (x, y) in enumerate(zip(prev, now, strict=True)):
            same = x is y if isinstance(x, torch.Tensor) else x == y
            # One computed from the model inputs alone (Gemma2's masks alternate by layer) is
            # each stage's own, block by block; one computed from an outer module is sent once.
            own = not src0[p] and not src1[p]
            if p != found[0] and not same and not own:
                raise refuse(
                    "a block argument computed from an outer module's output must be the same "
                    "for every block"
                )
    if found is None:  # one block: its first tensor argument is the hidden state
        found = (next(p for p, x in enumerate(leaves) if isinstance(x, torch.Tensor)), None)
        if not isinstance(calls[0].out, torch.Tensor):
            found = (found[0], 0)
    return found
