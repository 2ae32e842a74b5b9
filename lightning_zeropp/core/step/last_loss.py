"""A user's loss on the last stage: a function of the last stage's output and the micro-batch's
labels (and any per-row tensors of the batch), with the global batch's count, and its metrics.

A pipeline has the model's output (the logits) only on the last stage, one micro-batch at a
time, inside the step: a loss computed from the logits outside the model (transformers'
`compute_loss_func`, label smoothing, a sequence-level loss, a distillation term) must run there.
It follows HF's convention for losses under gradient accumulation:

    fn(output, labels, num_items_in_batch=n, **rows) -> loss  or  (loss, {name: scalar})

where `loss` is the micro-batch's summed per-item loss divided by `n` (HF's `ForCausalLMLoss`,
`LabelSmoother` and a `compute_loss_func` written for the Trainer all do so). The step averages
the micro-batches' losses over micro-batches and data-parallel ranks, so `n` is the global
batch's item count divided by both: the step's loss is then the global batch's item mean, as one
process computes it, however unevenly the items fall into micro-batches. Items are the labels
other than `ignore_index`, past the first `shift` of each row (1 for a causal LM, whose position
t predicts t+1). The metrics are combined as the loss is (mean over micro-batches, then over
data-parallel ranks) and sent to every rank (`share_metrics`), so every rank logs the same
numbers. Nothing here knows a framework: the fronts call it from their loss function.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_zeropp.core._torch_private import tree_flatten

__all__ = ["LastStageLoss", "LastLossStep", "global_items", "share_metrics"]

IGNORE_INDEX = -100  # HF's and torch's cross-entropy default: "no loss here"


@dataclass(frozen=True)
class LastStageLoss:
    """A loss computed on the last stage (see the module's docstring for `fn`'s contract).

    `shift`: leading labels of each row that are never counted (1 for a causal LM); `rows`:
    names of per-row tensors of the batch handed to `fn` (sliced to the micro-batch) and not to
    the model; `ignore_index`: the label that counts nothing; `group`: rows per unit that
    a micro-batch never splits (a preference pair's chosen and rejected rows: 2), so that a
    forward-only call runs as many micro-batches as split the units, not the rows."""

    fn: Callable[..., Any]
    shift: int = 0
    rows: tuple[str, ...] = ()
    ignore_index: int = IGNORE_INDEX
    group: int = 1

    def items(self, labels: torch.Tensor) -> torch.Tensor:
        """This batch's counted labels (fp64 scalar)."""
        counted = labels[..., self.shift :] if labels.dim() >= 2 else labels
        return (counted != self.ignore_index).sum().to(torch.float64)


def global_items(
    loss: LastStageLoss,
    labels: torch.Tensor,
    shares: int,
    dp_groups: Sequence[Any],
    device: torch.device,
) -> float:
    """Collective over the data-parallel groups: the `num_items_in_batch` each micro-batch's
    loss is divided by, the global batch's items over the `shares` losses the step averages
    (micro-batches x data-parallel ranks: the front's `fronts.microbatches.loss_shares`).
    Raises `ValueError` (on every rank alike) when nothing is counted."""
    total = loss.items(labels).to(device)
    for group in dp_groups:
        dist.all_reduce(total, group=group)
    if int(total) == 0:
        raise ValueError(
            f"the global batch has no counted label (every label is {loss.ignore_index}): its "
            "loss would divide by zero"
        )
    return float(total) / shares


@dataclass
class LastLossStep:
    """One step's calls of `loss.fn` on the last stage, one per micro-batch, in order (the
    last stage runs its forwards in micro-batch order under every schedule).

    `target` is the whole batch's labels as the schedule splits them (into `micro` chunks along
    rows), `rows` the whole batch's per-row tensors, split the same way here; `items` the
    `num_items_in_batch` every call is given. Each call's metrics are kept for `share_metrics`.

    `whole`: under context parallelism the front hands each call the micro-batch's output
    gathered into whole sequences (the same on every CP rank), while the schedule's labels are
    this CP rank's part, shifted: `fn` is given the micro-batch's whole labels from `target`
    instead, unshifted, as one process gives them."""

    loss: LastStageLoss
    items: float
    micro: int
    target: torch.Tensor
    rows: Mapping[str, torch.Tensor] = field(default_factory=dict)
    metrics: list[dict[str, torch.Tensor]] = field(default_factory=list)
    whole: bool = False
    _calls: int = 0

    def probe(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """torch's shape-inference call (no micro-batch of the step): the first micro-batch's
        loss, nothing counted or kept. Under context parallelism (`whole`) a zero that backward
        runs through, as the Lightning front's probe: the output is this CP rank's part, which
        per-token rows of the whole sequence (DPO's completion mask) would not fit, and
        gathering it would be a collective outside the schedule's."""
        if self.whole:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
            zero = torch.zeros((), device=tensors[0].device if tensors else target.device)
            return sum((t.sum() * 0.0 for t in tensors if t.requires_grad), zero)
        rows = {k: v.tensor_split(self.micro)[0] for k, v in self.rows.items()}
        result = self.loss.fn(output, target, num_items_in_batch=self.items, **rows)
        return _split_result(result)[0]

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        index = self._calls
        self._calls += 1
        expected = self.target.tensor_split(self.micro)[index % self.micro]
        if self.whole:  # whole sequences (context parallelism): the rows must still agree
            if target.shape[:1] != expected.shape[:1]:
                raise RuntimeError(
                    f"last-stage loss call {index} got labels of {target.shape[0]} rows, "
                    f"micro-batch {index % self.micro} has {expected.shape[0]}"
                )
            target = expected
        elif target.shape != expected.shape:  # a schedule calling out of order would show here
            raise RuntimeError(
                f"last-stage loss call {index} got labels of shape {tuple(target.shape)}, "
                f"micro-batch {index % self.micro} has {tuple(expected.shape)}"
            )
        rows = {k: v.tensor_split(self.micro)[index % self.micro] for k, v in self.rows.items()}
        result = self.loss.fn(output, target, num_items_in_batch=self.items, **rows)
        value, metrics = _split_result(result)
        self.metrics.append({name: _scalar(name, m) for name, m in metrics.items()})
        return value


def _split_result(result: Any) -> tuple[torch.Tensor, Mapping[str, Any]]:
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping):
        return result[0], result[1]
    return result, {}


def _scalar(name: str, value: Any) -> torch.Tensor:
    tensor = torch.as_tensor(value.detach() if torch.is_tensor(value) else value)
    if tensor.numel() != 1:
        raise ValueError(
            f"the last-stage loss returned metric {name!r} of shape {tuple(tensor.shape)}; a "
            "metric is one number per micro-batch"
        )
    return tensor.reshape(()).to(torch.float64)


def share_metrics(
    metrics: list[dict[str, torch.Tensor]],
    device: torch.device,
    pp_group: Any,
    pp_size: int,
    last_pp_rank: int,
    dp_groups: Sequence[Any],
    dp_size: int,
) -> dict[str, float]:
    """Collective over the pipeline and data-parallel groups: the last stage's per-micro-batch
    metrics as the loss is combined (mean over micro-batches, then over data-parallel ranks),
    on every rank."""
    names = sorted({name for m in metrics for name in m})
    if pp_size > 1:  # only the last stage ran the loss: it names the metrics
        sent: list[Any] = [names]
        dist.broadcast_object_list(sent, group=pp_group, group_src=last_pp_rank)
        names = sent[0]
    if not names:
        return {}
    values = torch.zeros(len(names), dtype=torch.float64, device=device)
    if metrics:
        for i, name in enumerate(names):
            values[i] = torch.stack([m[name] for m in metrics if name in m]).mean()
    if pp_size > 1:
        dist.broadcast(values, group=pp_group, group_src=last_pp_rank)
    for group in dp_groups:
        dist.all_reduce(values, group=group)
    return dict(zip(names, (values / dp_size).tolist(), strict=True))
