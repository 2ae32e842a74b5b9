"""What a LightningModule logs inside a pipelined step, made whole again.

The user's step runs once per micro-batch, and its loss part only on the last stage, while
Lightning's loggers write from global rank 0. The recorder catches the `self.log` calls of the
steps, combines each value over the micro-batches with the `reduce_fx` it was logged with (a
mean, a sum, ...; all micro-batches have equal rows; a value weighted by its items, see
`lightning.weighting`, by them), sends the result from the last stage to every stage of the
pipeline, and replays it through the real `self.log` on every rank. So rank 0 shows the real
values, and `sync_dist=True` reduces over the data-parallel ranks only (every stage of a pipeline
replays the same value: reducing over them too would count it once per stage).
torchmetrics `Metric` objects are handled by `lightning.metric_steps`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torchmetrics import Metric

from lightning_zeropp.core.engine import ZeroPPEngine
from lightning_zeropp.lightning.metric_steps import StepMetrics, mergeable, metric_path, undone
from lightning_zeropp.lightning.weighting import WeightWatch

__all__ = ["LogRecorder", "Replayed"]

_REDUCE = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
_REDUCE_FN = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}


@dataclass
class _Record:
    values: list[torch.Tensor | float] = field(default_factory=list)
    # per micro-batch: the weight of the logged value, looked up at replay (a loss's weight is
    # known once its step returned)
    weights: list[Callable[[], torch.Tensor | None]] = field(default_factory=list)
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Replayed:
    """What the last stage learnt about a step, on every rank of its pipeline."""

    skipped: torch.Tensor  # one element: 1.0 if some micro-batch skipped the batch
    weight: torch.Tensor | None  # the global batch's total loss weight, if the loss was weighted
    objects: Any = None  # predictions, or the extra keys of the returned dicts


class LogRecorder:
    """Patches `module.log` while a pipelined step runs; see the module docstring."""

    def __init__(self) -> None:
        self._records: dict[str, _Record] = {}
        self._metrics: dict[str, tuple[str, tuple[Any, ...], dict[str, Any]]] = {}
        self._step_metrics = StepMetrics()
        self._mute = 0
        self._patched = 0
        self._in_microbatch = False
        self._layout: Any = None  # the last step's (what a receiving stage knows)
        self.watch: WeightWatch | None = None  # the running micro-batch's
        self.dp_group: dist.ProcessGroup | None = None  # all data-parallel ranks of this stage

    @contextlib.contextmanager
    def recording(self, module: pl.LightningModule, engine: ZeroPPEngine) -> Iterator[None]:
        last = engine.dims.pp_rank == engine.last_pp_rank
        with self._patch(module), self._step_metrics.fresh(module, last):
            yield

    @contextlib.contextmanager
    def muted(self, module: pl.LightningModule) -> Iterator[None]:
        """Drop every log call and undo every metric update inside."""
        with self._patch(module), undone(module):
            self._mute += 1
            try:
                yield
            finally:
                self._mute -= 1

    @contextlib.contextmanager
    def microbatch(self, watch: WeightWatch | None = None) -> Iterator[None]:
        """Log calls inside belong to one real micro-batch's step."""
        self._in_microbatch, self.watch = True, watch
        try:
            yield
        finally:
            self._in_microbatch, self.watch = False, None

    def replay(
        self,
        module: pl.LightningModule,
        engine: ZeroPPEngine,
        skipped: bool,
        objects: Any = None,
        loss_weights: list[torch.Tensor] | None = None,
        global_weights: bool = True,
    ) -> Replayed:
        """Combine, send from the last stage to all stages, and log for real on every rank.

        `objects` (predictions, a step's extra returned keys) and the step's `loss_weights` (see
        `lightning.weighting`) travel along. `global_weights`: a weighted value is the global
        batch's mean once reduced over data-parallel ranks (training), else this rank's (eval).

        The values cross as one tensor of numbers; what they are (names, `self.log` arguments,
        metric paths: the layout) crosses pickled only when it differs from the last step's,
        and objects when there are some. So a training step reads nothing to the host here but
        a 3-number header, and on one pipeline stage not even that.
        """
        layout, numbers = self._step_numbers(module, engine, skipped, loss_weights, global_weights)
        self._records.clear()
        self._metrics.clear()
        if engine.config.pp_size > 1:
            layout, numbers, objects = self._exchange(engine, layout, numbers, objects)
        self._layout = layout
        values, metrics, weighted = layout
        at = 2  # numbers[0]: the skip flag, numbers[1]: the loss weight
        for name, args, kwargs in values:
            module.log(name, numbers[at], *args, **self._synced(kwargs))
            at += 1
        for name, path, has_value, args, kwargs in metrics:
            metric: Any = module.get_submodule(path)  # a torchmetrics Metric
            if has_value:  # what Lightning shows as the step's value
                metric._forward_cache = numbers[at]
                at += 1
            module.log(name, metric, *args, **kwargs)
        return Replayed(numbers[:1], numbers[1] if weighted else None, objects)

    def finish(self, module: pl.LightningModule) -> None:
        self._step_metrics.finish(module)

    def _synced(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`sync_dist=True` reduces over the data-parallel ranks (see the module docstring)."""
        if not kwargs.get("sync_dist") or "sync_dist_group" in kwargs:
            return kwargs
        if self.dp_group is None:  # one data-parallel rank: every rank already has the value
            return {**kwargs, "sync_dist": False}
        return {**kwargs, "sync_dist_group": self.dp_group}

    def _step_numbers(
        self,
        module: pl.LightningModule,
        engine: ZeroPPEngine,
        skipped: bool,
        loss_weights: list[torch.Tensor] | None,
        global_weights: bool,
    ) -> tuple[Any, torch.Tensor]:
        """This rank's layout and numbers (skip flag, loss weight, values, metric values)."""
        device = engine.device
        combined, sums, weights = [], [], []
        for record in self._records.values():
            value, weight = _combine(record, device)
            combined.append(value)
            if weight is not None:
                sums.append(len(combined) - 1)
                weights.append(weight)
        weighted = loss_weights is not None
        step_weight = (
            torch.stack(loss_weights).sum().float() if loss_weights is not None else torch.zeros(())
        )
        totals = torch.stack([step_weight.to(device), *weights])
        if global_weights and engine.dims.dp_size > 1 and (weighted or sums):
            for group in engine.dims.dp_groups:  # the last stage's data-parallel ranks only
                dist.all_reduce(totals, group=group)
        scale = engine.dims.dp_size if global_weights else 1
        for i, at in enumerate(sums):  # a weighted value: its sum over its items' total
            combined[at] = combined[at] * scale / totals[i + 1]
        values = tuple((name, r.args, r.kwargs) for name, r in self._records.items())
        metric_values = {
            name: self._step_metrics.step_value(module, path)
            for name, (path, _, _) in self._metrics.items()
        }
        metrics = tuple(
            (name, path, metric_values[name] is not None, args, kwargs)
            for name, (path, args, kwargs) in self._metrics.items()
        )
        numbers = torch.cat(
            [
                torch.tensor([float(skipped)], device=device),
                totals[:1].to(device),
                *(v.reshape(1).to(device) for v in combined),
                *(v.reshape(1).to(device) for v in metric_values.values() if v is not None),
            ]
        )
        return (values, metrics, weighted), numbers

    def _exchange(
        self, engine: ZeroPPEngine, layout: Any, numbers: torch.Tensor, objects: Any
    ) -> tuple[Any, torch.Tensor, Any]:
        """The last stage's layout, numbers and objects, on every rank of the pipeline."""
        group, src = engine.dims.pp_group, engine.last_pp_rank
        sending = engine.dims.pp_rank == src
        facts = [numbers.numel(), layout != self._layout, objects is not None]
        header = torch.tensor(facts if sending else [0, 0, 0], device=engine.device)
        dist.broadcast(header, group=group, group_src=src)
        size, changed, has_objects = header.tolist()
        if changed or has_objects:
            box = [(layout, objects)]
            dist.broadcast_object_list(box, group=group, group_src=src)
            sent_layout, sent_objects = box[0]
            layout = sent_layout if changed else self._layout
            objects = sent_objects
        else:
            layout = self._layout
        if not sending:
            numbers = torch.empty(size, device=engine.device)
        dist.broadcast(numbers, group=group, group_src=src)
        return layout, numbers, objects

    @contextlib.contextmanager
    def _patch(self, module: pl.LightningModule) -> Iterator[None]:
        if self._patched == 0:
            module.log = self._log  # type: ignore[method-assign]  # instance attribute; log_dict goes through it too
            self._module = module
        self._patched += 1
        try:
            yield
        finally:
            self._patched -= 1
            if self._patched == 0:
                del module.log

    def _log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if self._mute or not self._in_microbatch:
            return
        if isinstance(value, Metric):
            path = metric_path(self._module, name, value)
            if not mergeable(value) and kwargs.get("on_step") is not False:
                raise ValueError(
                    f"self.log({name!r}, {type(value).__name__}): this metric's states cannot be "
                    "merged (full_state_update), so its per-step value is not available under "
                    "ZeroPPStrategy; log it with on_step=False, on_epoch=True."
                )
            self._metrics[name] = (path, args, kwargs)
            return
        # Kept where it is (no host sync per micro-batch): the step's values cross once, in replay.
        if torch.is_tensor(value) and value.numel() == 1:
            number: torch.Tensor | float = value.detach().float().reshape(())
        elif isinstance(value, (int, float)):
            number = float(value)
        else:
            raise ValueError(
                f"ZeroPPStrategy logs scalars and torchmetrics Metric objects (got {name!r}="
                f"{type(value).__name__}); log a scalar tensor or number."
            )
        record = self._records.setdefault(name, _Record(args=args, kwargs=kwargs))
        record.values.append(number)
        record.weights.append(_weight_lookup(value, self.watch))


def _weight_lookup(value: Any, watch: WeightWatch | None) -> Callable[[], torch.Tensor | None]:
    if watch is None or not torch.is_tensor(value):
        return lambda: None
    ref = weakref.ref(value)
    return lambda: watch.weight_of(ref())


def _combine(record: _Record, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A name's value over the step's micro-batches and, for a weighted one, its total weight
    (the value is then the weighted sum)."""
    values = torch.stack(
        [torch.as_tensor(v, dtype=torch.float32, device=device) for v in record.values]
    )
    weights = [lookup() for lookup in record.weights]
    if weights and all(w is not None for w in weights):
        w = torch.stack([x.to(device) for x in weights])  # type: ignore[union-attr]
        return (values * w).sum(), w.sum()
    fx = record.kwargs.get("reduce_fx", "mean")
    kind = _REDUCE.get(fx.lower()) if isinstance(fx, str) else _REDUCE_FN.get(fx)
    if kind == "sum":
        return values.sum(), None
    if kind == "max":
        return values.max(), None
    if kind == "min":
        return values.min(), None
    return values.mean(), None
