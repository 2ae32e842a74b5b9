"""What a LightningModule logs inside a pipelined step, made whole again.

The user's step runs once per micro-batch, and only on the last stage, while Lightning's loggers
write from global rank 0. The recorder catches `self.log` calls made per micro-batch, averages each
metric over the micro-batches, sends the result from the last stage to every stage of the pipeline,
and replays it through the real `self.log` on every rank. So rank 0 shows the real values and
`sync_dist=True` averages over data-parallel ranks without the loss-less ranks diluting it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_zeropp.core.engine import ZeroPPEngine

__all__ = ["LogRecorder"]


class LogRecorder:
    """Patches `module.log` while a pipelined step runs; see the module docstring."""

    def __init__(self) -> None:
        self._records: dict[str, tuple[list[float], tuple[Any, ...], dict[str, Any]]] = {}
        self._mute = 0
        self._patched = 0
        self._in_microbatch = False

    @contextlib.contextmanager
    def recording(self, module: pl.LightningModule) -> Iterator[None]:
        with self._patch(module):
            yield

    @contextlib.contextmanager
    def muted(self, module: pl.LightningModule) -> Iterator[None]:
        """Drop every log call (input capture, shape inference)."""
        with self._patch(module):
            self._mute += 1
            try:
                yield
            finally:
                self._mute -= 1

    @contextlib.contextmanager
    def microbatch(self, rows: int) -> Iterator[None]:
        """Log calls inside belong to one real micro-batch (all micro-batches are equal-sized)."""
        self._in_microbatch = True
        try:
            yield
        finally:
            self._in_microbatch = False

    def replay(self, module: pl.LightningModule, engine: ZeroPPEngine) -> None:
        """Average, send from the last stage to all stages, and log for real on every rank."""
        payload = {
            name: (sum(values) / len(values), args, kwargs)
            for name, (values, args, kwargs) in self._records.items()
        }
        self._records.clear()
        if engine.config.pp_size > 1:
            box = [payload]
            dist.broadcast_object_list(
                box, group=engine.dims.pp_group, group_src=engine.last_pp_rank
            )
            payload = box[0]
        device = engine.device
        for name, (value, args, kwargs) in payload.items():
            module.log(name, torch.tensor(value, device=device), *args, **kwargs)

    @contextlib.contextmanager
    def _patch(self, module: pl.LightningModule) -> Iterator[None]:
        if self._patched == 0:
            module.log = self._log  # instance attribute; log_dict goes through it too
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
        if torch.is_tensor(value) and value.numel() == 1:
            number = float(value.detach().float())
        elif isinstance(value, (int, float)):
            number = float(value)
        else:
            raise ValueError(
                f"ZeroPPStrategy can log scalars only (got {name!r}={type(value).__name__}); "
                "log metric values (metric.compute()) rather than metric objects for now."
            )
        values, _, _ = self._records.setdefault(name, ([], args, kwargs))
        values.append(number)
