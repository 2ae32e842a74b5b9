"""split="stack": each stage a pruned copy of the model (see `core.split.methods`), and the check
that a model keeps the contract that makes it work, run once with an example micro-batch.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from lightning_zeropp.core._torch_private import tree_map
from lightning_zeropp.core.split.blocks import BlockPlan, num_params
from lightning_zeropp.core.split.copies import meta_copy

__all__ = ["check_stack", "stack_stage"]


def stack_stage(
    model: nn.Module, plan: BlockPlan, stage: int, shared: dict[int, Any] | None = None
) -> nn.Module:
    """A copy of `model` holding only this stage's blocks (names kept) and its pre/post modules
    (`shared`: objects the copy keeps as they are, e.g. the tensors for a check)."""
    first, last = stage == 0, stage == len(plan.ranges) - 1
    keep = {plan.names[i] for i in plan.ranges[stage]}
    # Copy everything except the blocks of other stages, which are never materialized twice.
    memo: dict[int, Any] = dict(shared or {})
    container = model.get_submodule(plan.container)
    for name, block in container._modules.items():
        if name not in keep:
            memo[id(block)] = None
    stage_model = copy.deepcopy(model, memo)
    new_container = stage_model.get_submodule(plan.container)
    new_container._modules = {n: m for n, m in new_container._modules.items() if n in keep}
    _drop_outer_modules(stage_model, plan.container, first, last)
    return stage_model


def check_stack(
    model: nn.Module,
    plan: BlockPlan,
    example_args: tuple[Any, ...] | None,
    example_kwargs: dict[str, Any] | None,
) -> None:
    """Run the stacked stages in a chain with one example micro-batch: a forward that does not
    keep split='stack''s contract fails here, at setup and on every rank, with the reason,
    instead of in the first step. On the meta device first (no memory, no compute); a forward
    that reads values (`.item()`) is run once more on the model's own tensors, without grad."""
    example = (tuple(example_args or ()), dict(example_kwargs or {}))
    if _stack_failure(meta_copy(model), plan, tree_map(_meta, example)) is None:
        return
    # Module objects copied, parameters and buffers shared: no memory for the weights.
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    with torch.no_grad():
        failure = _stack_failure(model, plan, example, shared)
    if failure is None:
        return
    stage, err = failure
    dropped = _dropped_names(model, plan.container, stage == 0, stage == len(plan.ranges) - 1)
    raise ValueError(
        f"split='stack' cannot run {type(model).__name__}: stage {stage}'s forward failed "
        f"({type(err).__name__}: {err}). A stacked stage is the model with the modules of other "
        f"stages set to None (here {dropped or 'none'}) and, after the first, is called with the "
        "previous stage's outputs only; its forward must skip modules that are None and take the "
        "hidden state as its input (torchtitan's contract). Use split='call' (the default), "
        "which runs the forward as written."
    ) from err


def _stack_failure(
    model: nn.Module,
    plan: BlockPlan,
    example: tuple[tuple[Any, ...], dict[str, Any]],
    shared: dict[int, Any] | None = None,
) -> tuple[int, Exception] | None:
    """The first stage whose stacked forward raises, chained as the pipeline chains them."""
    args, kwargs = example
    for stage in range(len(plan.ranges)):
        try:
            out = stack_stage(model, plan, stage, shared)(*args, **(kwargs if stage == 0 else {}))
        except Exception as err:
            return stage, err
        args, kwargs = (out if isinstance(out, tuple) else (out,)), {}
    return None


def _meta(x: Any) -> Any:
    return torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x


def _dropped_names(model: nn.Module, container: str, first: bool, last: bool) -> list[str]:
    """The modules and root parameters `_drop_outer_modules` sets to None on a stage."""
    probe = meta_copy(model)
    _drop_outer_modules(probe, container, first, last)
    kept = {n for n, _ in probe.named_modules()} | {n for n, _ in probe.named_parameters()}
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    gone = {n for n in names if n and n not in kept}
    return sorted(n for n in gone if n.rpartition(".")[0] not in gone)


def _drop_outer_modules(model: nn.Module, container: str, first: bool, last: bool) -> None:
    """Set modules before the block container to None off the first stage, after it off the last.

    Walks the path to the container: at each level, siblings registered before the path go with the
    first stage, siblings after it with the last stage. Parameter-free modules stay everywhere.
    """
    if not container:  # the model itself is the block container: nothing sits around it
        return
    parent = model
    for part in container.split("."):
        names = list(parent._modules.keys())
        pos = names.index(part)
        for i, name in enumerate(names):
            child = parent._modules[name]
            if i == pos or child is None or num_params(child) == 0:
                continue
            if (i < pos and not first) or (i > pos and not last):
                parent._modules[name] = None
        parent = parent.get_submodule(part)
    # Root-level parameters (rare) cannot be split by position: keep them on the first stage.
    if not first:
        for pname in list(model._parameters):
            model._parameters[pname] = None
