"""Losses that are means over a number of items (real tokens of padded rows): their micro-batches
weighted by their items, so a batch's loss is the mean over its items as one process computes it.

The pipeline runs a step once per micro-batch and averages what the step returns. A mean over the
real tokens of a micro-batch is not the batch's token mean when micro-batches hold different
numbers of real tokens: the mean of micro-batch means weighs a token of a short micro-batch more.
A micro-batch's loss therefore carries its number of items, its weight, when the library knows it:

- the step returns `{"loss": loss, "num_items": n}`: `loss` is a mean over `n` items;
- or the loss is, as returned, the result of `F.cross_entropy` / `F.nll_loss` with
  `reduction="mean"` (also through `nn.CrossEntropyLoss`) over class indices: its items are the
  targets that are not `ignore_index` (weighted by `weight` when given). `WeightWatch` sees those
  calls in the step and computes them as a sum divided by that count: the same value, and a
  micro-batch whose targets are all ignored gives 0 instead of NaN.

A weighted step's micro-batch losses enter the pipeline as `loss x weight`, and the step's
gradients and loss are divided by the total weight of the global batch afterwards (gradients are
linear in the loss), so the update is the one of the mean over every item of the global batch.
Logged values that are such losses are weighted alike. Without a weight, the mean over
micro-batches stands, and the strategy says so once (`UNWEIGHTED`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_zeropp.fronts.hf_loss import NUM_ITEMS as NUM_ITEMS_HF
from lightning_zeropp.fronts.hf_loss import TokenRule
from lightning_zeropp.fronts.loss_rule import CountedMeans, LossWatch, TokenCountAdapter

__all__ = ["NUM_ITEMS", "UNWEIGHTED", "GlobalTokenCount", "WeightWatch", "loss_weight"]

NUM_ITEMS = "num_items"

UNWEIGHTED = (
    "ZeroPPStrategy: training_step's loss is averaged over the {micro} micro-batches of each batch "
    "(and over data-parallel ranks) as returned. If it is a mean over a number of items that can "
    "differ between micro-batches (the real tokens of padded rows), return "
    "{{'loss': loss, 'num_items': n}}, n being how many items the loss averages: the batch's loss "
    "and gradients are then the mean over every item of the global batch, as in one process. A "
    "loss returned as F.cross_entropy / F.nll_loss computed it (reduction='mean') is weighted by "
    "its targets that are not ignore_index without this."
)


class WeightWatch(CountedMeans):
    """Active in a step's thread: each mean-reduced `F.cross_entropy` / `F.nll_loss` over class
    indices is computed as a sum over the counted targets, and its result is remembered with that
    count (`weight_of`); the same mechanism settles an HF model's own loss (`fronts.loss_rule`)."""


def loss_weight(result: Any, loss: torch.Tensor, watch: WeightWatch) -> torch.Tensor | None:
    """The weight of a step's loss (see the module docstring), as a float32 tensor, or None."""
    if isinstance(result, dict) and NUM_ITEMS in result:
        given = result[NUM_ITEMS]
        if not (torch.is_tensor(given) and given.numel() == 1) and not isinstance(
            given, (int, float)
        ):
            raise ValueError(
                f"training_step returned num_items={given!r}; give the number of items the loss "
                "averages over (an int or a one-element tensor)."
            )
        return torch.as_tensor(given, dtype=torch.float32, device=loss.device).detach().reshape(())
    return watch.weight_of(loss)


class GlobalTokenCount(TokenCountAdapter):
    """`TokenCountAdapter` over the global batch: a plain HF model's loss divides by the labelled
    tokens of every data-parallel rank's batch (`count` sums this rank's over them), so the
    update is the mean over the global batch's tokens, as in one process (and as the Accelerate
    front weighs them), not the mean of each rank's token mean."""

    def __init__(
        self,
        rule: TokenRule,
        watch: LossWatch | None,
        count: Callable[[torch.Tensor], torch.Tensor],
        ranks: int,
        model: Any = None,
        context: bool = False,
    ) -> None:
        super().__init__(rule, watch, count, ranks)
        # Under context parallelism each CP rank's forward holds part of every sequence: the
        # labels stay out of the stages, and the model's own loss_function runs on the whole
        # sequences' logits the step continues with (the same on every CP rank).
        self.model, self.context = model, context

    def stage_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.context and NUM_ITEMS_HF in kwargs:
            # the step's own count would leave the loss to the model on each CP rank's part of
            # the sequences, which has none to give: refused (every rank runs the same call)
            raise ValueError(
                f"under context parallelism (cp_size > 1) the step passes {NUM_ITEMS_HF}= to the "
                "HF model; pass labels=... only: each CP rank holds part of every sequence, so "
                "the library counts the global batch's labelled tokens itself."
            )
        args, kwargs = super().stage_inputs(args, kwargs)
        if not self.context:
            return args, kwargs
        if "shift_labels" in kwargs:
            raise ValueError(
                "under context parallelism (cp_size > 1) the step passes shift_labels to the HF "
                "model; pass labels=... (shifted on the whole sequence by the model's loss)."
            )
        return args, {k: v for k, v in kwargs.items() if k not in ("labels", NUM_ITEMS_HF)}

    def stage_output(self, output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        labels = kwargs.get("labels")
        if self.context and isinstance(labels, torch.Tensor) and self._items is not None:
            logits = output.get("logits") if hasattr(output, "get") else None
            if not isinstance(logits, torch.Tensor):
                raise ValueError(
                    f"{type(self.model).__name__} returned no logits: under context "
                    "parallelism its loss is computed from the whole sequences' logits."
                )
            config = self.model.config
            loss = self.model.loss_function(
                logits=logits,
                labels=labels,
                vocab_size=config.vocab_size,
                **{NUM_ITEMS_HF: self._items},
            )
            output["loss"] = loss
        return super().stage_output(output, args, kwargs)

    def idle(self) -> None:
        """This rank skips the step: it still joins the others' count (with none)."""
        if self.counts and self._count is not None:
            self._count(torch.zeros((), dtype=torch.float64))
