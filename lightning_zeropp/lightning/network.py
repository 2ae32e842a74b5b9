"""The network a LightningModule holds, as `ZeroPPStrategy` sees it: what is pipelined, how a step
reaches it, one micro-batch of its inputs (for the split), and Lightning's model summary of it.

The network is what the module trains, as the module's code runs it:
- its one child holding every trainable parameter (`self.model`), called by the step as
  `self.model(...)` (directly or through the module's forward), or the child `module_name` names;
- otherwise the LightningModule itself, through its own `forward`: its layers are its attributes
  (nanoGPT's `tok_emb`, `pos_emb`, `blocks`, `ln_f`, `head`), or it pairs an encoder with a head,
  or it holds parameters of its own (a learned `logit_scale`). The step calls `self(...)`; the
  call split cuts `forward` at its block calls, and each module and parameter goes with the stage
  whose code runs it. During a step the parts are stand-ins: the step may use them only through
  `self(...)`.
A trainable parameter outside the network would never be updated: refused at setup, named.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelSummary
from torch import nn
from torchmetrics import Metric

from lightning_zeropp.lightning.redirect import (
    Elsewhere,
    ElsewhereTensor,
    StandIn,
    away_message,
)

__all__ = ["Network", "summarize_whole_model"]

_MODULE_STATE = nn.Module().__dict__


class Network:
    """Where the pipelined network lives in `module` (`attr`: a child's name; None: the module
    itself, through its forward)."""

    def __init__(self, module: pl.LightningModule, attr: str | None) -> None:
        self.module, self.attr = module, attr
        self.owner = type(module).__name__
        # The root's parts: children with parameters and parameters of its own.
        self.children = (
            [n for n, c in module.named_children() if _has_params(c)] if attr is None else []
        )
        self.params = (
            [n for n, p in module._parameters.items() if p is not None] if attr is None else []
        )
        self.net: nn.Module = getattr(module, attr) if attr is not None else _view(module)
        self._installed: nn.Module | None = None
        self._away: list[_Part] = []  # the parts other stages hold (`install`)
        self.names: list[str] = []  # every parameter of the whole network, under the module

    @staticmethod
    def of(module: pl.LightningModule, module_name: str | None) -> Network:
        """The module's network (see the module docstring); refuses what it would not train."""
        trainable = [n for n, p in module.named_parameters() if p.requires_grad]
        if module_name is not None:
            if module_name == "" or not isinstance(getattr(module, module_name, None), nn.Module):
                holders = [n for n, c in module.named_children() if _has_params(c)]
                raise ValueError(
                    f"module_name={module_name!r} is not a submodule of {type(module).__name__}, "
                    f"whose submodules with parameters are {holders}; pass "
                    "ZeroPPStrategy(module_name=...) the one to pipeline, or leave it out to "
                    "pipeline the module's own forward."
                )
            _refuse_outside(module, module_name, trainable)
            return Network(module, module_name)
        owners = {n.split(".")[0] for n in trainable}
        if len(owners) == 1 and isinstance(getattr(module, next(iter(owners))), nn.Module):
            return Network(module, next(iter(owners)))
        if not trainable:  # nothing trains (predict, evaluate): its one child with parameters
            holders = [n for n, c in module.named_children() if _has_params(c)]
            if len(holders) == 1 and not module._parameters:
                return Network(module, holders[0])
        if type(module).forward is pl.LightningModule.forward:
            raise ValueError(
                f"{type(module).__name__} trains parameters outside one child module "
                f"({sorted(owners)}); ZeroPPStrategy then pipelines the module's own forward, "
                "which it does not define. Define forward to compute with them (e.g. return "
                "self.head(self.encoder(x))) and call self(...) in training_step, or pass "
                "module_name=... naming the one child to pipeline, with the rest frozen."
            )
        return Network(module, None)

    @property
    def call(self) -> str:
        """How the step calls the network, for messages."""
        return f"self.{self.attr}(...)" if self.attr is not None else "self(...)"

    def install(self, merged: nn.Module, whole: nn.Module, stages: str) -> None:
        """Put this rank's stages (`merged`, under the network's names) in the network's place;
        `whole` is a meta copy of the unsplit network, `stages` this rank's stage ids (text).

        A part another stage holds is, in this rank's stages, a stub or a placeholder of zeros
        that the stage's code runs on. Outside a step it is a guard naming `full_parameter`
        (`Elsewhere`, `ElsewhereTensor`): a stale copy must never be read as the trained value."""
        self._installed = merged
        prefix = f"{self.attr}." if self.attr is not None else ""
        self.names = [f"{prefix}{n}" for n, _ in whole.named_parameters()]
        self._away = _away_parts(merged, whole, prefix, stages)
        if self.attr is not None:
            self.module._modules[self.attr] = merged
            self._guard(True)
            return
        top = {(id(d), key) for d, key, _, _ in self._away if d is merged.__dict__}
        top |= {(id(d), key) for d, key, _, _ in self._away if d is merged._modules}
        guards = {key: guard for d, key, _, guard in self._away if (id(d), key) in top}
        self._away = [part for part in self._away if (id(part[0]), part[1]) not in top]
        for name in self.children:
            self.module._modules[name] = guards.get(name, merged._modules[name])
        # Its parts are this rank's stages now: a call outside a step would compute garbage.
        self.module.__dict__["forward"] = functools.partial(_outside_steps, self.owner)
        for name in self.params:
            held = merged._parameters.get(name)
            self.module._parameters.pop(name, None)
            self.module.__dict__.pop(name, None)
            if held is not None:
                self.module._parameters[name] = held
            else:  # another stage's: a guard, never a copy (zeros, or stale)
                guard = guards.get(name)
                if guard is None:
                    guard = ElsewhereTensor.make("", name, away_message(name, name, stages))
                self.module.__dict__[name] = guard
        self._guard(True)

    def _guard(self, on: bool) -> None:
        """Guards (`on`) or the stage's own stubs and placeholders in the parts held elsewhere:
        the stage's code runs on the latter inside a step."""
        for holder, key, real, guard in self._away:
            holder[key] = guard if on else real

    def installed(self, merged: nn.Module) -> bool:
        return self._installed is merged

    @contextlib.contextmanager
    def redirected(self, fn: Callable[..., Any]) -> Iterator[None]:
        """While a step runs: its network call goes to `fn`; the network's parts are stand-ins."""
        module = self.module
        self._guard(False)
        try:
            with self._redirected(module, fn):
                yield
        finally:
            self._guard(True)

    @contextlib.contextmanager
    def _redirected(self, module: pl.LightningModule, fn: Callable[..., Any]) -> Iterator[None]:
        if self.attr is not None:
            real = module._modules[self.attr]
            module._modules[self.attr] = StandIn(fn, self.attr)
            try:
                yield
            finally:
                module._modules[self.attr] = real
            return
        children = {n: module._modules[n] for n in self.children}
        params = {n: module._parameters.pop(n, None) for n in self.params}
        plain = {n: module.__dict__.pop(n) for n in self.params if n in module.__dict__}
        for name in self.children:
            module._modules[name] = Elsewhere.in_step(self.owner, name)
        for name in self.params:
            module.__dict__[name] = ElsewhereTensor.make(self.owner, name)
        guard = module.__dict__.get("forward")
        module.forward = fn  # type: ignore[method-assign]  # instance attribute: nn.Module.__call__ reads self.forward
        try:
            yield
        finally:
            del module.forward
            if guard is not None:
                module.__dict__["forward"] = guard
            module._modules.update(children)
            for name in self.params:
                del module.__dict__[name]
                if params[name] is not None:
                    module._parameters[name] = params[name]
            module.__dict__.update(plain)

    @contextlib.contextmanager
    def showing(self, whole: nn.Module) -> Iterator[None]:
        """`whole` (a meta copy of the unsplit network) in the network's place while inside."""
        module = self.module
        if self.attr is not None:
            stages, module._modules[self.attr] = module._modules[self.attr], whole
            try:
                yield
            finally:
                module._modules[self.attr] = stages
            return
        children = {n: module._modules[n] for n in self.children}
        params = dict(module._parameters)
        module._modules.update({n: whole._modules[n] for n in self.children})
        module._parameters.update({n: whole._parameters[n] for n in self.params})
        try:
            yield
        finally:
            module._modules.update(children)
            module._parameters.clear()
            module._parameters.update(params)


_Part = tuple[dict[str, Any], str, Any, Any]  # (the dict holding it, its key, real, guard)


def _away_parts(real: nn.Module, whole: nn.Module, prefix: str, stages: str) -> list[_Part]:
    """The parts of `whole` that `real` (this rank's stages) holds as another stage's: a module
    with parameters in `whole` and none here (a stub), or a parameter here as a plain tensor (a
    placeholder); each with its guard. Parts absent from `real` (other splits) stay absent."""
    out: list[_Part] = []
    for name, param in whole._parameters.items():
        held = real.__dict__.get(name)
        if param is not None and name not in real._parameters and isinstance(held, torch.Tensor):
            path = f"{prefix}{name}"
            guard = ElsewhereTensor.make("", path, away_message(path, path, stages))
            out.append((real.__dict__, name, held, guard))
    for name, part in whole._modules.items():
        mine = real._modules.get(name)
        if part is None or mine is None or not _has_params(part):
            continue
        path = f"{prefix}{name}"
        if not _has_params(mine) and not mine._modules:  # held by another stage: a stub here
            out.append((real._modules, name, mine, Elsewhere(away_message(path, None, stages))))
        else:
            out += _away_parts(mine, part, f"{path}.", stages)
    return out


def _refuse_outside(module: pl.LightningModule, name: str, trainable: list[str]) -> None:
    outside = [n for n in trainable if n != name and not n.startswith(f"{name}.")]
    if outside:
        more = f" and {len(outside) - 4} more" if len(outside) > 4 else ""
        raise ValueError(
            f"module_name={name!r} leaves trainable parameters of {type(module).__name__} "
            f"outside the pipeline ({', '.join(outside[:4])}{more}): only the pipelined network "
            "is trained, so they would never be updated. Leave module_name out: ZeroPPStrategy "
            "then pipelines the module's own forward (have it compute with them and call "
            "self(...) in the step); or freeze them (requires_grad_(False))."
        )


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _view(module: pl.LightningModule) -> nn.Module:
    """The LightningModule as a network to split: an object of its class sharing its attributes,
    children and parameters, with hooks of its own and without its metrics (sharding it or
    stepping its stages never touches the LightningModule itself)."""
    view = object.__new__(type(module))
    state = dict(vars(module))
    for key, empty in _MODULE_STATE.items():
        if key in ("_parameters", "_buffers", "_modules"):
            state[key] = dict(state[key])
        elif key != "training":
            state[key] = type(empty)() if empty is not None else None
    state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    state["_modules"] = {n: m for n, m in state["_modules"].items() if not isinstance(m, Metric)}
    view.__dict__.update(state)
    view.log = _no_log  # type: ignore[method-assign]  # a stage's forward runs on stub values on other stages
    return view


def _outside_steps(owner: str, *args: Any, **kwargs: Any) -> Any:
    raise ValueError(
        f"{owner}'s forward was called outside a step: under ZeroPPStrategy it is the pipelined "
        "network, split into stages across ranks, and runs only inside training_step, "
        "validation_step, test_step and predict_step (use trainer.predict for inference)."
    )


def _no_log(name: str, *args: Any, **kwargs: Any) -> None:
    raise ValueError(
        f"self.log({name!r}, ...) in forward: under ZeroPPStrategy the LightningModule's forward "
        "runs inside the pipeline's stages; log in training_step (or validation_step)."
    )


def summarize_whole_model(trainer: pl.Trainer, network: Network, whole: nn.Module) -> None:
    """Lightning's model summary would count this rank's stages; show it the whole network
    (a meta-device copy: parameter counts, no memory) while it summarizes."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's connector
        if not isinstance(callback, ModelSummary):
            continue
        summarize = getattr(callback, "_zeropp_summarize", callback.on_fit_start)

        def on_fit_start(trainer: pl.Trainer, pl_module: pl.LightningModule, f=summarize) -> None:
            with network.showing(whole):
                f(trainer, pl_module)

        callback._zeropp_summarize = summarize  # type: ignore[attr-defined]
        callback.on_fit_start = on_fit_start  # type: ignore[method-assign]
