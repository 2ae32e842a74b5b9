"""The pieces of a step's micro-batches: their network calls joined into the batch's, the random
state a pipeline's ranks share, what a step returned checked, merged and made a loss."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_zeropp.core._torch_private import tree_flatten, tree_unflatten
from lightning_zeropp.core.engine import ZeroPPEngine

__all__ = ["check_loss", "concat_calls", "detached", "merge", "scalar", "sync_random_state", "zero"]


def sync_random_state(engine: ZeroPPEngine) -> None:
    """Every rank of a pipeline takes the first stage's random state (the stages' own work, e.g.
    dropout in their blocks, draws differently on each), so what a step draws before its
    network call is drawn alike on every stage."""
    if engine.config.pp_size == 1:
        return
    group = engine.dims.pp_group
    states = [(torch.get_rng_state, torch.set_rng_state)]
    if engine.device.type == "cuda":
        states.append((torch.cuda.get_rng_state, torch.cuda.set_rng_state))
    for get, put in states:
        state = get().to(engine.device)
        dist.broadcast(state, group=group, group_src=0)
        put(state.cpu())


def concat_calls(
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The micro-batches' network calls as one call of the whole batch (tensors joined along
    rows; everything else must be the same in every micro-batch)."""
    flat = [tree_flatten((tuple(a), dict(k))) for a, k in calls]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        raise ValueError(
            "the step called the network with arguments of another structure in some "
            "micro-batches of the batch; call it alike for every part of a batch."
        )
    leaves = []
    for parts in zip(*(leaves for leaves, _ in flat), strict=True):
        first = parts[0]
        if torch.is_tensor(first) and first.dim() > 0:
            leaves.append(torch.cat(parts))
        elif all(
            (x is first) or (torch.is_tensor(x) and torch.equal(x, first)) or x == first
            for x in parts
        ):
            leaves.append(first)
        else:
            raise ValueError(
                f"the step passed the network {first!r} for one micro-batch and {parts[1]!r} "
                "for another; a value that is not per row must be the same for the whole batch."
            )
    return tree_unflatten(leaves, spec)


def check_loss(loss: Any) -> None:
    if torch.is_tensor(loss) and loss.numel() == 1 and loss.requires_grad:
        return
    if not torch.is_tensor(loss):
        what = f"{loss!r} ({type(loss).__name__})"
    elif loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}"
    else:
        what = "a tensor that does not require grad"
    raise ValueError(
        f"training_step returned {what} as its loss; return a scalar tensor computed "
        "from the model's output (e.g. loss.mean())."
    )


def detached(x: Any) -> Any:
    return x.detach() if torch.is_tensor(x) else x


def scalar(loss: torch.Tensor) -> torch.Tensor:
    """A one-element loss as a 0-d tensor that is not a view (the zero-bubble schedules detach
    the last stage's loss in place, which views refuse)."""
    return loss if loss.dim() == 0 else loss.sum()


def zero(output: Any, grad: bool) -> torch.Tensor:
    """A zero loss on the output's device; with `grad`, one backward can run through."""
    tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t)]
    zero = torch.zeros((), device=tensors[0].device if tensors else "cpu")
    if grad:
        return sum((t.sum() * 0.0 for t in tensors if t.requires_grad), zero)
    return zero


def merge(outputs: list[Any], averaged: bool) -> Any:
    """Per-micro-batch values as one batch: tensors with rows joined along them, dicts key by
    key, lists joined; with `averaged`, one-element values averaged (micro-batches have equal
    rows, so a mean over a micro-batch's rows averages to the batch's)."""
    if not outputs:
        return None
    if all(isinstance(o, dict) for o in outputs):
        keys = outputs[0].keys()
        return {k: merge([o.get(k) for o in outputs], averaged) for k in keys}
    if all(torch.is_tensor(o) and o.dim() > 0 for o in outputs):
        return torch.cat(outputs)
    if not averaged:
        return [x for o in outputs for x in (o if isinstance(o, list) else [o])]
    if all(torch.is_tensor(o) and o.dim() == 0 for o in outputs):
        return torch.stack(outputs).float().mean()
    if all(isinstance(o, (int, float)) and not isinstance(o, bool) for o in outputs):
        return sum(outputs) / len(outputs)
    return [x for o in outputs for x in (o if isinstance(o, list) else [o])]
