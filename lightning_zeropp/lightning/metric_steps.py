"""torchmetrics `Metric` objects of a LightningModule through a pipelined step.

They are logged as objects on every rank. During a step each of the module's metrics starts from
an empty state on the last stage, so its value after the step is the step's value (what one
process shows for the batch); its earlier state is merged back after. At epoch end Lightning calls
`compute()` on every rank, which sums the states over all ranks: the ranks without the last stage
hold empty states, so the result is the global one.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torchmetrics import Metric

__all__ = ["StepMetrics", "mergeable", "metric_path", "undone"]


class StepMetrics:
    """The module's metrics around one step (see the module docstring)."""

    def __init__(self) -> None:
        self._saved: dict[str, Metric] = {}  # the metrics' states before the step

    @contextlib.contextmanager
    def fresh(self, module: pl.LightningModule, last: bool) -> Iterator[None]:
        """On the last stage, each mergeable metric starts the step empty and unsynced."""
        metrics = (
            [(p, m) for p, m in module.named_modules() if isinstance(m, Metric)] if last else []
        )
        syncs = {}
        for path, metric in metrics:
            # A compute() inside the step runs on the last stage only: it must not sync.
            # (torchmetrics reads `_to_sync`, set from `sync_on_compute` at construction.)
            syncs[path], metric._to_sync = metric._to_sync, False
            if mergeable(metric):
                self._saved[path] = copy.deepcopy(metric)
                metric.reset()
        try:
            yield
        finally:
            for path, metric in metrics:
                metric._to_sync = syncs[path]

    def step_value(self, module: pl.LightningModule, path: str) -> torch.Tensor | None:
        """The metric's value over this step's updates (last stage)."""
        metric: Any = module.get_submodule(path)  # a torchmetrics Metric
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
            metric: Any = module.get_submodule(path)  # a torchmetrics Metric
            metric.merge_state(saved)
            metric._update_count += saved._update_count
        self._saved.clear()


@contextlib.contextmanager
def undone(module: pl.LightningModule) -> Iterator[None]:
    """Every metric update inside is undone afterwards (code that is not a real micro-batch's
    step, or a rank whose updates the last stage's stand for)."""
    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    states = [(m, copy.deepcopy(m.metric_state), m._update_count) for m in metrics]
    try:
        yield
    finally:
        for metric, state, count in states:
            for name, value in state.items():
                setattr(metric, name, value)
            metric._update_count = count


def metric_path(module: pl.LightningModule, name: str, value: Metric) -> str:
    path = next((p for p, m in module.named_modules() if m is value), None)
    if path is None:
        raise ValueError(
            f"self.log({name!r}, metric): ZeroPPStrategy logs Metric objects that are "
            "attributes of the LightningModule (so every rank holds one); assign it to "
            "self in __init__."
        )
    return path


def mergeable(metric: Metric) -> bool:
    return metric.full_state_update is False and not metric.dist_sync_on_step
