"""How a user's step reaches the pipelined network: a stand-in for it, and the first batch.

While the user's `training_step` (or forward) runs, the LightningModule's pipelined child (e.g.
`self.model`) is replaced by a `StandIn`. Everything else runs as written: the module's own
`forward` around `self.model(...)`, the loss, the logging. The stand-in either captures the call's
arguments (the pipeline's inputs) or returns the pipeline's output for the micro-batch. What it
cannot honour (a second call in one micro-batch, a call of one of the network's submodules) is an
error naming the fix, never a silently different number.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

__all__ = ["Captured", "StandIn", "first_batch"]


class Captured(Exception):
    """Raised by the stand-in when capturing: hands back the network call's arguments."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


class StandIn(nn.Module):
    """Stands in for the pipelined network while a user step runs: calls `fn`, at most once."""

    def __init__(self, fn: Callable[..., Any], attr: str) -> None:
        super().__init__()
        self.fn, self.attr, self.calls = fn, attr, 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > 1:
            raise ValueError(
                f"the step called self.{self.attr} more than once for one batch. Under "
                "ZeroPPStrategy the pipeline runs the network once per micro-batch and the step "
                f"receives that output; call self.{self.attr} (or self) once per step, or put "
                "both calls inside the network's own forward."
            )
        return self.fn(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            raise AttributeError(
                f"self.{self.attr}.{name} is not reachable inside a step under ZeroPPStrategy: "
                f"self.{self.attr} is split into pipeline stages across ranks and runs as a whole. "
                f"Call self.{self.attr}(...) itself, or pass module_name=... naming the part to "
                "pipeline, with the rest outside it."
            ) from None


def first_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the loader the running stage will use (fit: training; else its own).

    Read before training to learn the model's input shapes; the random generators are restored
    afterwards, so the run draws the same numbers as without this peek.
    """
    fn = trainer.state.fn
    loops = {
        TrainerFn.FITTING: (trainer.fit_loop, "train_dataloader"),
        TrainerFn.VALIDATING: (trainer.validate_loop, "val_dataloaders"),
        TrainerFn.TESTING: (trainer.test_loop, "test_dataloaders"),
        TrainerFn.PREDICTING: (trainer.predict_loop, "predict_dataloaders"),
    }
    loop, attr = loops[fn]
    with _rng_kept():
        loop.setup_data()
        loader = getattr(trainer, attr)
        if isinstance(loader, (list, tuple)):
            loader = loader[0] if loader else None
        elif isinstance(loader, dict):
            loader = next(iter(loader.values()), None)
        if loader is None:
            raise ValueError(
                f"ZeroPPStrategy found no {attr} to learn the model's input shapes from; set the "
                "LightningModule's example_input_array (one micro-batch of forward inputs)."
            )
        try:
            return next(iter(loader))
        except StopIteration:
            raise ValueError(f"the {attr} is empty: there is no batch to train on.") from None


@contextmanager
def _rng_kept() -> Iterator[None]:
    state = random.getstate()
    try:
        import numpy as np

        np_state: Any = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        np, np_state = None, None
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(state)
    if np is not None:
        np.random.set_state(np_state)
