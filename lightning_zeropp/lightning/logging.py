"""What a LightningModule logs inside a pipelined step, made whole again.

The user's step runs once per micro-batch, and only on the last stage, while Lightning's loggers
write from global rank 0. The recorder catches `self.log` calls made per micro-batch, averages each
value over the micro-batches (they are equal-sized), sends the result from the last stage to every
stage of the pipeline, and replays it through the real `self.log` on every rank. So rank 0 shows
the real values and `sync_dist=True` averages over data-parallel ranks without the loss-less ranks
diluting it.

torchmetrics `Metric` objects are logged as objects on every rank. During a step each of the
module's metrics starts from an empty state on the last stage, so its value after the step is the
step's value (what one process shows for the batch); its earlier state is merged back after. At
epoch end Lightning calls `compute()` on every rank, which sums the states over all ranks: the
ranks without the last stage hold empty states, so the result is the global one.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torchmetrics import Metric

from lightning_zeropp.core.engine import ZeroPPEngine

__all__ = ["LogRecorder"]


class LogRecorder:
    """Patches `module.log` while a pipelined step runs; see the module docstring."""

    def __init__(self) -> None:
        self._records: dict[
            str, tuple[list[torch.Tensor | float], tuple[Any, ...], dict[str, Any]]
        ] = {}
        self._metrics: dict[str, tuple[str, tuple[Any, ...], dict[str, Any]]] = {}
        self._saved: dict[str, Metric] = {}  # the metrics' states before the step
        self._mute = 0
        self._patched = 0
        self._in_microbatch = False
        self._layout: Any = ((), ())  # the last step's (what a receiving stage knows)

    @contextlib.contextmanager
    def recording(self, module: pl.LightningModule, engine: ZeroPPEngine) -> Iterator[None]:
        with self._patch(module), self._fresh_metrics(module, engine):
            yield

    @contextlib.contextmanager
    def muted(self, module: pl.LightningModule) -> Iterator[None]:
        """Drop every log call and undo every metric update (input capture, shape inference:
        the runtime's shape-inference pass runs the step on a micro-batch of dummy inputs)."""
        metrics = [m for m in module.modules() if isinstance(m, Metric)]
        states = [(m, copy.deepcopy(m.metric_state), m._update_count) for m in metrics]
        with self._patch(module):
            self._mute += 1
            try:
                yield
            finally:
                self._mute -= 1
                for metric, state, count in states:
                    for name, value in state.items():
                        setattr(metric, name, value)
                    metric._update_count = count

    @contextlib.contextmanager
    def microbatch(self) -> Iterator[None]:
        """Log calls inside belong to one real micro-batch (all micro-batches are equal-sized)."""
        self._in_microbatch = True
        try:
            yield
        finally:
            self._in_microbatch = False

    def replay(
        self, module: pl.LightningModule, engine: ZeroPPEngine, extra: dict[str, Any]
    ) -> dict[str, Any]:
        """Average, send from the last stage to all stages, and log for real on every rank.

        `extra` ({"skipped": bool, "predictions": ...}: what the last stage learnt about the
        step) travels along and is returned everywhere, "skipped" as a one-element tensor.

        The values cross as one tensor of numbers; what they are (names, `self.log` arguments,
        metric paths: the layout) crosses pickled only when it differs from the last step's,
        and predictions (predict steps) always. So a training step reads nothing to the host
        here but the 3-number header, and on one pipeline stage not even that.
        """
        layout, numbers = self._step_numbers(module, engine.device, extra["skipped"])
        self._records.clear()
        self._metrics.clear()
        if engine.config.pp_size > 1:
            layout, numbers, extra = self._exchange(engine, layout, numbers, extra)
        values, metrics = layout
        at = 1  # numbers[0] is the skip flag
        for name, args, kwargs in values:
            module.log(name, numbers[at], *args, **kwargs)
            at += 1
        for name, path, has_value, args, kwargs in metrics:
            metric = module.get_submodule(path)
            if has_value:  # what Lightning shows as the step's value
                metric._forward_cache = numbers[at]
                at += 1
            module.log(name, metric, *args, **kwargs)
        return {"skipped": numbers[:1], "predictions": extra["predictions"]}

    def _step_numbers(
        self, module: pl.LightningModule, device: torch.device, skipped: bool
    ) -> tuple[Any, torch.Tensor]:
        """This rank's layout and numbers (skip flag, means, metric values), on the device."""
        means = _means([values for values, _, _ in self._records.values()], device)
        values = tuple((name, args, kwargs) for name, (_, args, kwargs) in self._records.items())
        metric_values = {
            name: self._step_value(module, path) for name, (path, _, _) in self._metrics.items()
        }
        metrics = tuple(
            (name, path, metric_values[name] is not None, args, kwargs)
            for name, (path, args, kwargs) in self._metrics.items()
        )
        numbers = torch.cat(
            [
                torch.tensor([float(skipped)], device=device),
                means,
                *(v.reshape(1).to(device) for v in metric_values.values() if v is not None),
            ]
        )
        return (values, metrics), numbers

    def _exchange(
        self,
        engine: ZeroPPEngine,
        layout: Any,
        numbers: torch.Tensor,
        extra: dict[str, Any],
    ) -> tuple[Any, torch.Tensor, dict[str, Any]]:
        """The last stage's layout, numbers and predictions, on every rank of the pipeline."""
        group, src = engine.dims.pp_group, engine.last_pp_rank
        sending = engine.dims.pp_rank == src
        facts = [numbers.numel(), layout != self._layout, extra["predictions"] is not None]
        header = torch.tensor(facts if sending else [0, 0, 0], device=engine.device)
        dist.broadcast(header, group=group, group_src=src)
        size, changed, predictions = header.tolist()
        if changed or predictions:
            box = [(layout, extra["predictions"])]
            dist.broadcast_object_list(box, group=group, group_src=src)
            sent_layout, sent_predictions = box[0]
            self._layout = sent_layout if changed else self._layout
            extra = {**extra, "predictions": sent_predictions}
        if not sending:
            numbers = torch.empty(size, device=engine.device)
        dist.broadcast(numbers, group=group, group_src=src)
        return self._layout, numbers, extra

    @contextlib.contextmanager
    def _fresh_metrics(self, module: pl.LightningModule, engine: ZeroPPEngine) -> Iterator[None]:
        """On the last stage, each mergeable metric starts the step empty and unsynced."""
        last = engine.dims.pp_rank == engine.last_pp_rank
        metrics = (
            [(p, m) for p, m in module.named_modules() if isinstance(m, Metric)] if last else []
        )
        syncs = {}
        for path, metric in metrics:
            # A compute() inside the step runs on the last stage only: it must not sync.
            # (torchmetrics reads `_to_sync`, set from `sync_on_compute` at construction.)
            syncs[path], metric._to_sync = metric._to_sync, False
            if _mergeable(metric):
                self._saved[path] = copy.deepcopy(metric)
                metric.reset()
        try:
            yield
        finally:
            for path, metric in metrics:
                metric._to_sync = syncs[path]

    def _step_value(self, module: pl.LightningModule, path: str) -> torch.Tensor | None:
        """The metric's value over this step's updates (last stage), then its state merged back."""
        metric = module.get_submodule(path)
        if path not in self._saved or not metric._update_count:
            return None
        probe = copy.deepcopy(metric)  # compute() caches on the metric: not on the real one
        probe._to_sync = False  # this step's value on this rank's data, like one process's
        result = probe.compute()
        scalar = torch.is_tensor(result) and result.numel() == 1
        return result.detach().float().reshape(()) if scalar else None

    def finish(self, module: pl.LightningModule) -> None:
        """Merge the states the metrics had before the step back into them (last stage)."""
        for path, saved in self._saved.items():
            metric = module.get_submodule(path)
            metric.merge_state(saved)
            metric._update_count += saved._update_count
        self._saved.clear()

    @contextlib.contextmanager
    def _patch(self, module: pl.LightningModule) -> Iterator[None]:
        if self._patched == 0:
            module.log = self._log  # instance attribute; log_dict goes through it too
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
            path = next((p for p, m in self._module.named_modules() if m is value), None)
            if path is None:
                raise ValueError(
                    f"self.log({name!r}, metric): ZeroPPStrategy logs Metric objects that are "
                    "attributes of the LightningModule (so every rank holds one); assign it to "
                    "self in __init__."
                )
            if not _mergeable(value) and kwargs.get("on_step") is not False:
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
        values, _, _ = self._records.setdefault(name, ([], args, kwargs))
        values.append(number)


def _means(records: list[list[torch.Tensor | float]], device: torch.device) -> torch.Tensor:
    """Each name's mean over the step's micro-batches, one float32 tensor on the device."""
    means = [
        torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device) for v in values]).mean()
        for values in records
    ]
    return torch.stack(means) if means else torch.zeros(0, device=device)


def _mergeable(metric: Metric) -> bool:
    return metric.full_state_update is False and not metric.dist_sync_on_step
