"""How a user's step reaches the pipelined network: stand-ins for it and its parts, the first
batch, and a step at setup that leaves no trace.

While the user's `training_step` runs, the network call (`self.model(...)`, or `self(...)` when
the LightningModule's own forward is the network) reaches the pipeline (`lightning.steps`).
Everything else runs as written. What a stand-in cannot honour (a call of one of the network's
submodules, a read of one of its parameters outside the network) is an error naming the fix,
never a silently different number.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_zeropp.core._torch_private import make_subclass

__all__ = [
    "Elsewhere",
    "ElsewhereTensor",
    "StandIn",
    "attributes_kept",
    "away_message",
    "first_batch",
    "rng_kept",
]


class StandIn(nn.Module):
    """Stands in for the pipelined child (`self.model`) while a user step runs: calls `fn`."""

    def __init__(self, fn: Callable[..., Any], attr: str) -> None:
        super().__init__()
        self.fn, self.attr = fn, attr

    def forward(self, *args: Any, **kwargs: Any) -> Any:
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


def _outside_forward(owner: str, name: str) -> str:
    return (
        f"the step uses self.{name} outside {owner}.forward: under ZeroPPStrategy the "
        f"LightningModule's forward is the pipelined network, split into stages across ranks, "
        f"and only it runs the modules and parameters it is built from (self.{name} among "
        f"them). Use self.{name} inside forward and call self(...) in the step."
    )


class Elsewhere(nn.Module):
    """Stands in for a part of a pipelined LightningModule's own network (a child with
    parameters): while a step runs, the step may reach it only through `self(...)`; outside a
    step, on a rank whose stages do not hold it, any use names `full_parameter`
    (`away_message`). Any call or attribute read raises `message`."""

    def __init__(self, message: str) -> None:
        super().__init__()
        object.__setattr__(self, "_message", message)

    @staticmethod
    def in_step(owner: str, name: str) -> Elsewhere:
        """The stand-in for `self.<name>` while a step runs."""
        return Elsewhere(_outside_forward(owner, name))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(self._message)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            return super().__getattr__(name)
        raise ValueError(self.__dict__["_message"])


class ElsewhereTensor(torch.Tensor):
    """Stands in for a parameter of a pipelined LightningModule's own network while a step
    runs (any use of it says that only forward may use it), or, outside a step, for one another
    pipeline stage holds (any use names `full_parameter`: `away_message`)."""

    @staticmethod
    def make(owner: str, name: str, message: str | None = None) -> ElsewhereTensor:
        guard = make_subclass(ElsewhereTensor, torch.empty(0))
        guard._message = message if message is not None else _outside_forward(owner, name)
        return guard

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        leaves = [*args, *(kwargs or {}).values()]
        guard = next(x for x in leaves if isinstance(x, ElsewhereTensor))
        raise ValueError(guard._message)


def away_message(path: str, parameter: str | None, stages: str) -> str:
    """What reading `self.<path>` says on a rank whose stages do not hold it (outside a step)."""
    name = parameter if parameter is not None else f"{path}.<name>"
    return (
        f"self.{path} is held by another pipeline stage under ZeroPPStrategy: this rank holds "
        f"stage {stages} only, and no copy of it (one would be stale). Read its trained value on "
        f"every rank with lightning_zeropp.full_parameter(self, {name!r}), weight norms with "
        "lightning_zeropp.param_norm(self) (both collective: call them on every rank), or the "
        "whole state with trainer.strategy.full_state_dict()."
    )


@contextmanager
def attributes_kept(module: nn.Module) -> Iterator[None]:
    """Undo what code inside does to `module`'s own plain attributes (a counter, a list of seen
    lengths, a tensor updated in place): the step run at setup to learn the input shapes is not
    a training step. Objects that cannot be copied are put back but not restored inside."""
    internal = set(nn.Module().__dict__)
    saved = {
        key: (value, _contents(value))
        for key, value in vars(module).items()
        if key not in internal and not isinstance(value, nn.Module)
    }
    try:
        yield
    finally:
        for key in [k for k, v in vars(module).items() if k not in internal | set(saved)]:
            if not isinstance(module.__dict__[key], nn.Module):
                del module.__dict__[key]
        for key, (value, contents) in saved.items():
            _restore(value, contents)
            module.__dict__[key] = value


def _contents(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, dict, set)):
        try:
            return copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - not restorable: kept as it is
            return None
    return None


@torch.no_grad()
def _restore(value: Any, contents: Any) -> None:
    if contents is None:
        return
    if isinstance(value, torch.Tensor):
        value.copy_(contents)
    elif isinstance(value, list):
        value[:] = contents
    else:
        value.clear()
        value.update(contents)


def first_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the loader the running stage will use (fit: training; else its own).

    Read before training to learn the model's input shapes; the random generators are restored
    afterwards, so the run draws the same numbers as without this peek.
    """
    fn = trainer.state.fn
    loops: dict[TrainerFn | None, tuple[Any, str]] = {
        TrainerFn.FITTING: (trainer.fit_loop, "train_dataloader"),
        TrainerFn.VALIDATING: (trainer.validate_loop, "val_dataloaders"),
        TrainerFn.TESTING: (trainer.test_loop, "test_dataloaders"),
        TrainerFn.PREDICTING: (trainer.predict_loop, "predict_dataloaders"),
    }
    loop, attr = loops[fn]
    with rng_kept():
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
            raise ValueError(_empty_loader(attr, loader)) from None


def _empty_loader(attr: str, loader: Any) -> str:
    """Why `loader` gave no batch, with the fix: most often a dataset smaller than one batch
    per data-parallel rank under `drop_last=True`."""
    try:
        rows: int | None = len(loader.dataset)
    except (AttributeError, TypeError):
        rows = None
    batch = getattr(loader, "batch_size", None)
    ranks = getattr(getattr(loader, "sampler", None), "num_replicas", 1)
    if rows == 0 or rows is None or not batch:
        return (
            f"the {attr} gave no batch: its dataset is empty ({rows} rows), so there is nothing "
            "to run on. Give it data (check the dataset's path and filters)."
        )
    drop = getattr(loader, "drop_last", False)
    how = " with drop_last=True, which drops the short batch" if drop else ""
    return (
        f"the {attr} gave no batch on this data-parallel rank: its dataset's {rows} rows are "
        f"fewer than one batch of {batch} rows per data-parallel rank ({ranks} ranks){how}, so "
        f"there is nothing to train on. Use more data, a smaller batch_size"
        f"{', or drop_last=False' if drop else ''}."
    )


@contextmanager
def rng_kept() -> Iterator[None]:
    state = random.getstate()
    try:
        import numpy as np

        np_state: Any = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        np_state = None
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(state)
    if np_state is not None:  # numpy is there
        np.random.set_state(np_state)
