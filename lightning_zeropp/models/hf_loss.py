"""HF models' loss conventions, shared by both fronts: token-weighted losses and the KV cache.

HF models mark positions without a target with -100 and average their loss over the labelled
tokens of whatever batch they see. Under a pipeline they see one micro-batch at a time, and the
mean of micro-batch means is not the batch's token mean when micro-batches hold different numbers
of labelled tokens (padding). HF's own remedy, `num_items_in_batch` (the divisor of the summed
loss, which transformers' Trainer passes for gradient accumulation), is used here too.

Which labels count is the model's business, so it is observed, not looked up by class name:
`token_rule(model)` calls the model's own `loss_function` on a tiny synthetic case (zero logits,
one labelled position at a time: each counted token adds log(vocab) to the summed loss) and reads
how many leading labels of a row are never targets (1 for causal LMs, which shift inside the
loss, whatever the class is called). `LossWatch` then checks, per micro-batch on the last stage,
that the model's forward really called that function with the count the front computed and with
the labels it counted: a forward that computes its own loss, drops `num_items_in_batch` or
changes the labels is an error, not a mean of means. Duck-typed: nothing here imports
transformers.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_zeropp.core.split.call_adapter import CallAdapter

__all__ = [
    "IGNORE_INDEX",
    "NUM_ITEMS",
    "LossWatch",
    "TokenCountAdapter",
    "TokenRule",
    "accepts_num_items",
    "disable_kv_cache",
    "token_counts",
    "token_rule",
]

IGNORE_INDEX = -100  # HF's label for "no loss here" (padding, prompts)
NUM_ITEMS = "num_items_in_batch"  # HF's keyword: divide the summed token loss by this
_PROBE_VOCAB, _PROBE_LEN = 4, 5  # the synthetic case: zero logits over 4 classes, 5 positions


def accepts_num_items(model: nn.Module) -> bool:
    """Whether `model`'s forward can hand `num_items_in_batch` to its `loss_function` (HF
    models whose forward passes its keyword arguments on: the test transformers' Trainer makes)."""
    flag = getattr(model, "accepts_loss_kwargs", None)
    if isinstance(flag, bool):
        return flag and hasattr(model, "loss_function")
    params = inspect.signature(model.forward).parameters.values()
    takes = any(p.kind is inspect.Parameter.VAR_KEYWORD or p.name == NUM_ITEMS for p in params)
    return takes and hasattr(model, "loss_function")


@dataclass(frozen=True)
class TokenRule:
    """How a model's loss counts labelled tokens, as observed from its `loss_function`.

    `shift`: leading labels of each row of `labels` that are never targets (1: a causal LM's
    position t predicts token t+1); `pre_shift`: the same for `shift_labels` when the loss
    reads them instead (0 for HF's causal LM loss), None when it ignores them."""

    shift: int
    pre_shift: int | None = None

    @property
    def causal(self) -> bool:
        """A causal LM's rule: position t predicts token t+1, so each row's first label is
        never a target (what makes padding a row or regrouping packed rows exact)."""
        return self.shift == 1

    def counts(
        self, labels: torch.Tensor, micro: int, shift_labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Labelled tokens in each of `micro` equal row blocks of the batch (fp64)."""
        if shift_labels is not None and self.pre_shift is not None:
            return token_counts(shift_labels, micro, self.pre_shift)
        return token_counts(labels, micro, self.shift)


def token_counts(labels: torch.Tensor, micro: int, shift: int) -> torch.Tensor:
    """Labels other than -100, past the first `shift` of each row, in each of `micro` equal row
    blocks of `labels` (fp64)."""
    rows = labels[..., int(shift) :] if labels.dim() >= 2 else labels
    per_row = (rows != IGNORE_INDEX).reshape(rows.shape[0], -1).sum(dim=1)
    return per_row.reshape(micro, -1).sum(dim=1).to(torch.float64)


def token_rule(model: nn.Module) -> TokenRule | None:
    """The model's token-counting rule, read from its own `loss_function` on a synthetic case;
    None when its forward cannot take `num_items_in_batch` or its loss does not behave as a sum
    of per-token losses divided by it (then the fronts cannot weigh micro-batches by tokens)."""
    if not accepts_num_items(model):
        return None
    loss_function = getattr(model, "loss_function", None)
    if not callable(loss_function):
        return None
    shift = _leading_skipped(loss_function, "labels")
    if shift is None or shift == _PROBE_LEN:
        return None
    pre_shift = _leading_skipped(loss_function, "shift_labels")
    return TokenRule(shift, None if pre_shift == _PROBE_LEN else pre_shift)


def _leading_skipped(loss_function: Callable[..., Any], key: str) -> int | None:
    """How many leading positions of `key` the loss never counts, if what it counts is every
    labelled position from there on and it divides its sum by `num_items_in_batch`."""
    length, unit = _PROBE_LEN, math.log(_PROBE_VOCAB)
    counted = []
    for position in [*range(length), None]:  # None: every position labelled
        labels = torch.ones(1, length, dtype=torch.long)
        if position is not None:
            labels.fill_(IGNORE_INDEX)[0, position] = 1
        value = _probe_loss(loss_function, key, labels, 1.0)
        if value is None or abs(value / unit - round(value / unit)) > 1e-3:
            return None
        counted.append(round(value / unit))
    *single, total = counted
    skipped = next((i for i, c in enumerate(single) if c), length)
    if single != [0] * skipped + [1] * (length - skipped) or total != length - skipped:
        return None
    halved = _probe_loss(loss_function, key, torch.ones(1, length, dtype=torch.long), 2.0)
    if halved is None or not math.isclose(2 * halved, total * unit, rel_tol=1e-4, abs_tol=1e-6):
        return None  # the divisor is not honoured
    return skipped


def _probe_loss(
    loss_function: Callable[..., Any], key: str, labels: torch.Tensor, items: float
) -> float | None:
    kwargs = {"labels": labels}
    if key == "shift_labels":
        kwargs = {"labels": torch.full_like(labels, IGNORE_INDEX), "shift_labels": labels}
    logits = torch.zeros(1, labels.shape[1], _PROBE_VOCAB)
    try:
        with torch.no_grad():
            loss = loss_function(
                logits=logits, vocab_size=_PROBE_VOCAB, **{NUM_ITEMS: items}, **kwargs
            )
        return float(loss)
    except Exception:  # a loss of another shape or signature: not one this can read
        return None


class LossWatch:
    """Wraps a model's `loss_function` to see, per call, the tokens it counts and its divisor.

    Installed on the model before it is split (the stages' copies share the wrapper). After
    the last stage ran a micro-batch whose loss the front weighted, `check` compares the last
    call (that micro-batch's: the last stage computes each loss right after its forward) with
    what the front counted."""

    def __init__(self, model: nn.Module, rule: TokenRule) -> None:
        self.rule = rule
        self.owner = type(model).__name__
        self._last: tuple[float, float | None] | None = None  # (tokens, num_items_in_batch)
        owner = _loss_owner(model)
        inner = owner.loss_function

        def watched(*args: Any, **kwargs: Any) -> Any:
            self._last = self._seen(args, kwargs)
            return inner(*args, **kwargs)

        owner.loss_function = watched  # HF's property has a setter; else an instance attribute

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

    def check(self, labels: torch.Tensor, items: float) -> None:
        """The micro-batch's loss was the model's `loss_function` on `labels`' tokens divided by
        `items`; raises (on the last stage: the fronts' failure board tells every rank)."""
        seen, self._last = self._last, None
        want = float(self.rule.counts(labels, 1).sum())
        divided = seen is not None and seen[1] is not None and math.isclose(seen[1], items)
        if divided and seen is not None and seen[0] == want:
            return
        raise ValueError(
            f"{self.owner}'s forward did not compute its loss as its loss_function on the labels "
            f"given, divided by num_items_in_batch={items:g} (last call saw: "
            f"{'none' if seen is None else f'{seen[0]:g} tokens, divisor {seen[1]}'}; expected "
            f"{want:g} tokens): its loss over padded micro-batches could not be made the batch's "
            "token mean. Have the forward pass its keyword arguments to self.loss_function, or "
            "compute the loss outside the model (prepare_pipeline's loss_fn, or a loss from the "
            "logits in your step)."
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


class TokenCountAdapter(CallAdapter):
    """Makes a padded batch's loss the mean over its labelled tokens, as one process computes
    it, not the mean of micro-batch means (which weighs a token of a short micro-batch more).

    For a model whose loss takes `num_items_in_batch`: a call with `labels=` gets
    `num_items_in_batch = tokens / microbatches`, so each micro-batch's loss is its token sum
    times `microbatches / tokens`, and the pipeline's mean over micro-batches is the batch's
    token mean. `microbatches` is set by the front before each call. Tokens are counted by the
    model's own rule (`token_rule`), and each micro-batch's loss is checked to be the model's
    loss function on them (`LossWatch`).
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
        labels = kwargs.get("labels")
        plain = "shift_labels" not in kwargs and isinstance(labels, torch.Tensor)
        if self.watch is not None and self._items is not None and plain:
            self.watch.check(labels, self._items)
        return output


def disable_kv_cache(model: nn.Module) -> None:
    """Turn off an HF model's KV cache, which its forward builds even in training unless told
    not to (as transformers' Trainer does under gradient checkpointing): a pipeline stage
    returns tensors only. Duck-typed, so calling it on any model is harmless; both fronts call
    it on the model they are given."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False
