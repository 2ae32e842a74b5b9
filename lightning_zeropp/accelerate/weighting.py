"""Token weighting in the Accelerate front: the loss is the mean over the global batch's real
tokens, as one process computes it over the whole batch.

The engine averages what the loss returns over micro-batches and data-parallel ranks. For a model
whose forward takes HF's `num_items_in_batch` (every HF causal LM does) the front passes it the
global batch's labelled tokens, counted by the model's own rule (`fronts.hf_loss.token_rule`),
divided by the micro-batch, data-parallel (and CP) counts the engine averages over: each micro-batch's
loss is then its token sum over the global count, and the average is the global token mean. For
other models the loss is the mean of micro-batch means, which equals the global mean only when
every micro-batch holds as many labelled tokens: a batch where they differ is refused.
Each process's share of an eval loss is weighted the same way (`accelerate.shares`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_zeropp.core.mesh import ParallelDims
from lightning_zeropp.fronts.hf_loss import NUM_ITEMS, TokenRule, token_counts
from lightning_zeropp.fronts.microbatches import loss_shares

__all__ = ["weigh_tokens"]


def weigh_tokens(
    kwargs: dict[str, Any],
    target: torch.Tensor,
    micro: int,
    rule: TokenRule | None,
    dims: ParallelDims,
    device: torch.device,
    model: nn.Module,
) -> tuple[dict[str, Any], float | None, float | None]:
    """Collective over the data-parallel groups: `kwargs` with `num_items_in_batch` set so that
    the engine's mean over micro-batches and data-parallel ranks is the mean over the global
    batch's labelled tokens, counted by the model's own `rule`; the count the forward is given
    (to settle its loss by, `LossWatch.settle`), or None when there is none to settle by; and
    the global batch's own count per micro-batch and rank (the divisor one process's call of a
    model that ignores the given count would use), or None.

    `kwargs` that carry `num_items_in_batch` already are the loop's own normalisation (the
    Trainer's count over its accumulation window): kept, and the batch's own count still read."""
    pre = kwargs.get("shift_labels")
    pre = pre if isinstance(pre, torch.Tensor) else None
    given = kwargs.get(NUM_ITEMS)
    if rule is not None:
        counts = rule.counts(target, micro, pre)
    else:  # no rule to read: only equal micro-batches are accepted below
        if given is not None:
            return kwargs, None, None
        counts = token_counts(pre if pre is not None else target, micro, 0)
    counts = counts.to(device)
    total = counts.sum()
    low, high = counts.min().clone(), counts.max().clone()
    for group in dims.dp_groups:
        dist.all_reduce(total, group=group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if rule is not None:
        # Under context parallelism each CP rank's loss sums its part of the tokens, and the
        # engine averages over CP ranks too: the count is divided by them as well.
        own = float(total) / loss_shares(micro, dims, cp_parts=True)
        if given is not None:
            # A shift_labels batch is not settled: its loss_function call is the model's own.
            return kwargs, (float(given) if pre is None else None), own or None
        if int(total) == 0:
            raise ValueError("the global batch has no labelled token (every label is -100)")
        # settled against the forward's own loss call on the last stage (`LossWatch`)
        return {**kwargs, NUM_ITEMS: own}, own if pre is None else None, own
    if int(low) != int(high):
        raise ValueError(
            f"micro-batches of this batch hold between {int(low)} and {int(high)} labelled "
            f"tokens, and {type(model).__name__}'s loss cannot be weighed by tokens "
            "(its forward does not pass num_items_in_batch to a loss_function that divides "
            "its token sum by it): its per-micro-batch mean losses would not average to the "
            "batch's token mean. Accept num_items_in_batch (divide the summed loss by it), "
            "or pass batches whose micro-batches hold equal numbers of labelled tokens."
        )
    return kwargs, None, None
