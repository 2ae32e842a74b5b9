"""One rule for a model's own loss under a pipeline: weighed exactly by tokens, or refused.

A pipeline runs the model once per micro-batch, and the batch's loss is the mean of what the
micro-batches return. One process computes the model's loss over the whole batch: its labelled
tokens' mean. The two agree only when each micro-batch's loss is its token sum over one divisor,
the same for every micro-batch (the batch's count over the micro-batches). Per micro-batch, on the
last stage, `LossWatch.settle` finds which of three things the model's forward did:

- it called its `loss_function` with the `num_items_in_batch` the front passed (HF causal LMs,
  seen by wrapping `loss_function`): the loss is already the token sum over the divisor;
- it returned a mean `F.cross_entropy` (also through `nn.CrossEntropyLoss`) over the labels the
  front counted (BERT's masked-LM loss, a causal LM computing its own loss): `CountedMeans`, a
  torch function mode active during the step, saw that call and its count, so the mean is
  rescaled to the same token sum over the divisor (`loss * count / divisor`), exactly;
- anything else (a mean computed by hand, class weights, other targets): no divisor can be
  known, and it is refused with an error naming the model, at its first step (the fronts'
  failure board tells every rank).

`TokenCountAdapter` applies the rule where the Lightning front calls an HF model; the Accelerate
front (and `ZeroPPTrainer` on it) calls `settle` from its loss function. Nothing here imports
transformers.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_zeropp.fronts.call_adapter import CallAdapter
from lightning_zeropp.fronts.hf_loss import NUM_ITEMS, TokenRule, token_counts, token_rule

__all__ = ["CountedMeans", "LossWatch", "TokenCountAdapter"]

_COUNTED = {
    F.cross_entropy: inspect.signature(F.cross_entropy),
    F.nll_loss: inspect.signature(F.nll_loss),
}


class CountedMeans(TorchFunctionMode):
    """While active (in the thread running the step): each mean-reduced `F.cross_entropy` /
    `F.nll_loss` over class indices is computed as a sum over the counted targets, and its result
    is remembered with that count (`weight_of`): the same value, and a micro-batch whose targets
    are all ignored gives 0 instead of NaN."""

    def __init__(self) -> None:
        super().__init__()
        self._weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def note(self, value: torch.Tensor, count: torch.Tensor) -> None:
        """`value` is a mean over `count` items (a returned loss with its `num_items`)."""
        self._weights[id(value)] = (value, count)

    def weight_of(self, value: Any) -> torch.Tensor | None:
        """The count a loss computed under this mode averages over, or None."""
        found = self._weights.get(id(value)) if torch.is_tensor(value) else None
        return found[1] if found is not None and found[0] is value else None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        signature = _COUNTED.get(func)
        if signature is None:
            return func(*args, **kwargs)
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        given = call.arguments
        target = given["target"]
        legacy = given["size_average"] is not None or given["reduce"] is not None
        if given["reduction"] != "mean" or legacy or target.is_floating_point():
            return func(*args, **kwargs)
        count = _count(target, given["weight"], given["ignore_index"])
        total = func(**{**given, "reduction": "sum"})
        out = total / torch.where(count > 0, count, torch.ones_like(count))
        self._weights[id(out)] = (out, count)
        return out


def _count(target: torch.Tensor, weight: torch.Tensor | None, ignore: int) -> torch.Tensor:
    """What a mean-reduced cross-entropy divides by: the targets that are not `ignore`, each
    weighted by its class weight when there are class weights."""
    counted = target != ignore
    if weight is None:
        return counted.sum().to(torch.float32)
    classes = torch.where(counted, target, torch.zeros_like(target))
    return (weight.detach()[classes] * counted).sum().to(torch.float32)


class LossWatch:
    """Wraps a model's `loss_function` to see, per call, the tokens it counts and its divisor,
    and settles each micro-batch's loss by the module's rule (`settle`).

    Installed on the model before it is split (the stages' copies share the wrapper). The last
    stage computes each micro-batch's loss right after its forward, so the last call seen is
    that micro-batch's."""

    def __init__(self, model: nn.Module, rule: TokenRule) -> None:
        self.rule = rule
        self.owner = type(model).__name__
        self.honoured = False  # the forward was seen taking the count: no counting needed
        self._last: tuple[float, float | None] | None = None  # (tokens, num_items_in_batch)
        self._counter: CountedMeans | None = None
        owner: Any = _loss_owner(model)  # Any: loss_function is HF's, unknown to nn.Module
        inner = owner.loss_function

        def watched(*args: Any, **kwargs: Any) -> Any:
            self._last = self._seen(args, kwargs)
            return inner(*args, **kwargs)

        owner.loss_function = watched  # HF's property has a setter; else an instance attribute

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Around a pipeline step (every stage's thread that runs forwards): mean losses are
        counted (`CountedMeans`), until the forward is seen taking the count itself."""
        if self.honoured:
            yield
            return
        counter = self._counter = CountedMeans()
        try:
            with counter:
                yield
        finally:
            self._counter = None

    def _seen(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, float | None]:
        # loss_function(logits, labels, vocab_size, **kwargs), or all by keyword
        labels = kwargs.get("labels", args[1] if len(args) > 1 else None)
        pre = kwargs.get("shift_labels")
        items = kwargs.get(NUM_ITEMS)
        items = None if items is None or _on_meta(items) else float(items)
        read = pre if isinstance(pre, torch.Tensor) and self.rule.pre_shift is not None else labels
        if not isinstance(read, torch.Tensor) or read.dim() < 1 or _on_meta(read):
            return math.nan, items  # no labels, or the split's dry run on the meta device
        if read is pre:
            return float(token_counts(pre, 1, self.rule.pre_shift or 0).sum()), items
        return float(token_counts(read, 1, self.rule.shift).sum()), items

    def settle(
        self,
        loss: torch.Tensor,
        labels: torch.Tensor,
        items: float,
        divisor: float | None = None,
        shifted: bool = False,
    ) -> torch.Tensor:
        """The micro-batch's loss (computed on `labels`, its forward given `num_items_in_batch=
        items`) as its token sum over one divisor: as returned when the forward's loss was its
        `loss_function` with `items`; a counted mean rescaled to its sum over `divisor` (default
        `items`: the count one process's call would divide by); else a `ValueError`.
        `shifted`: `labels` are already each position's target (context parallelism's part of
        the labels shifted on the whole sequence, what the forward got as `shift_labels`)."""
        seen, self._last = self._last, None
        counted_labels = token_counts(labels, 1, 0) if shifted else self.rule.counts(labels, 1)
        want = float(counted_labels.sum())
        divided = seen is not None and seen[1] is not None and math.isclose(seen[1], items)
        if divided and seen is not None and seen[0] == want:
            self.honoured = True
            return loss
        counted = self._counter.weight_of(loss) if self._counter is not None else None
        if counted is not None and float(counted) == want:
            return loss * (counted / (items if divisor is None else divisor))
        last = "none" if seen is None else f"{seen[0]:g} tokens, divisor {seen[1]}"
        mean = "none" if counted is None else f"over {float(counted):g} items"
        raise ValueError(
            f"{self.owner}'s forward did not compute its loss as its loss_function on the labels "
            f"given, divided by num_items_in_batch={items:g}, nor as a mean F.cross_entropy over "
            f"those labels (last loss_function call saw: {last}; a mean cross-entropy returned as "
            f"the loss: {mean}; expected {want:g} tokens): its loss over padded micro-batches "
            "could not be made the batch's token mean. Have the forward pass its keyword "
            "arguments to self.loss_function, or return F.cross_entropy(..., reduction='mean', "
            "ignore_index=-100) over the labels, or compute the loss outside the model "
            "(prepare_pipeline's loss_fn, or a loss from the logits in your step)."
        )


def _loss_owner(model: nn.Module) -> nn.Module:
    """The module whose own class defines `loss_function` (the one its forward calls as
    `self.loss_function`): `model` itself, or the model a wrapper forwards attribute reads to
    (PEFT's `PeftModel` wraps the HF model and reads its `loss_function` through `__getattr__`)."""
    for module in model.modules():
        if any("loss_function" in vars(cls) for cls in type(module).__mro__):
            return module
    return model


def _on_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


def with_loss(output: Any, loss: torch.Tensor) -> Any:
    """`output` (an HF `ModelOutput`, a dict or a tuple starting with the loss) with `loss`."""
    if loss is _loss_in(output):
        return output
    if isinstance(output, dict):  # ModelOutput is an OrderedDict: its attribute follows the key
        output["loss"] = loss
        return output
    if hasattr(output, "loss"):
        output.loss = loss
        return output
    if isinstance(output, tuple) and output:
        return (loss, *output[1:])
    raise TypeError(f"cannot put the weighed loss into a {type(output).__name__} output")


def _loss_in(output: Any) -> Any:
    if isinstance(output, dict):
        return output.get("loss")
    if hasattr(output, "loss"):
        return output.loss
    return output[0] if isinstance(output, tuple) and output else None


class TokenCountAdapter(CallAdapter):
    """Makes a padded batch's loss the mean over its labelled tokens, as one process computes
    it, not the mean of micro-batch means (which weighs a token of a short micro-batch more).

    For a model whose loss takes `num_items_in_batch`: a call with `labels=` gets
    `num_items_in_batch = tokens / microbatches`, so each micro-batch's loss is its token sum
    times `microbatches / tokens`, and the pipeline's mean over micro-batches is the batch's
    token mean. `microbatches` is set by the front before each call. Tokens are counted by the
    model's own rule (`token_rule`); each micro-batch's loss is settled by `LossWatch` (a mean
    cross-entropy the forward computed itself is rescaled to the same weighting, anything else
    refused); the front runs the step under `counting()`.
    """

    def __init__(
        self,
        rule: TokenRule,
        watch: LossWatch | None = None,
        count: Callable[[torch.Tensor], torch.Tensor] | None = None,
        ranks: int = 1,
    ) -> None:
        self.rule = rule
        self.watch = watch
        self.microbatches = 1
        # `count`: this batch's token count -> the count over every rank sharing the step
        # (`ranks` of them: each rank's micro-batch losses are averaged over all of them).
        self._count, self._ranks = count, ranks
        self.counts = False  # whether a call carried labels to count
        self._items: float | None = None  # what the last call was given

    @classmethod
    def for_model(cls, model: nn.Module) -> TokenCountAdapter | None:
        """The adapter for `model` (watching its loss), or None when its loss cannot be weighed
        by tokens (`token_rule`)."""
        rule = token_rule(model)
        return None if rule is None else cls(rule, LossWatch(model, rule))

    def counting(self) -> contextlib.AbstractContextManager[None]:
        """Around the pipeline step: what `settle` needs to see (`LossWatch.counting`)."""
        return self.watch.counting() if self.watch is not None else contextlib.nullcontext()

    def stage_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        labels = kwargs.get("labels")
        self._items = None
        if not isinstance(labels, torch.Tensor) or NUM_ITEMS in kwargs:
            return args, kwargs
        self.counts = True
        pre = kwargs.get("shift_labels")
        tokens = self.rule.counts(labels, 1, pre if isinstance(pre, torch.Tensor) else None).sum()
        total = float(tokens if self._count is None else self._count(tokens))
        if total == 0:
            scope = "batch" if self._count is None else "global batch"
            raise ValueError(f"the {scope} has no labelled token (every label is -100)")
        self._items = total / (self.microbatches * self._ranks)
        return args, {**kwargs, NUM_ITEMS: self._items}

    def stage_output(self, output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        labels: Any = kwargs.get("labels")
        plain = "shift_labels" not in kwargs and isinstance(labels, torch.Tensor)
        loss = _loss_in(output)
        if self.watch is not None and self._items is not None and plain and loss is not None:
            return with_loss(output, self.watch.settle(loss, labels, self._items))
        return output
