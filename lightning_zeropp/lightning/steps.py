"""A user's Lightning step run through the pipeline: captured inputs, per-micro-batch loss, outcome.

Every rank runs the user's step up to its network call (cheap: every rank holds the whole batch)
to learn the pipeline's inputs; the engine runs the schedule; on the last stage the user's step is
the loss function, once per micro-batch, with the network's output standing in for the call. What
only the last stage learns (the logged values, a step that returned None, predictions) is sent
to every stage with the logged values, so every rank acts alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from lightning_zeropp.core.engine import ZeroPPEngine
from lightning_zeropp.core.schedule.build import eval_microbatches
from lightning_zeropp.core.split.call_adapter import CallAdapter
from lightning_zeropp.core.step.batch import batch_size, take_rows
from lightning_zeropp.core.step.grads import StepGrads
from lightning_zeropp.lightning.logging import LogRecorder
from lightning_zeropp.lightning.redirect import Captured, StandIn

__all__ = ["StepOutcome", "StepRunner"]

MODES = ("train", "eval", "predict")


@dataclass
class StepOutcome:
    loss: torch.Tensor
    skipped: bool = False  # some micro-batch's training_step returned None (on any rank)
    predictions: Any = None
    grads: StepGrads | None = None  # a training step's, held for Lightning's backward


@dataclass
class _Step:
    fn: Callable[..., Any]
    batch: Any
    rest: tuple[Any, ...]
    mode: str
    skipped: bool = False
    outputs: list[Any] = field(default_factory=list)


class StepRunner:
    """Runs user steps through `engine` with `module`'s network child `attr` stood in for."""

    def __init__(self) -> None:
        self.recorder = LogRecorder()
        self.module: pl.LightningModule | None = None
        self.engine: ZeroPPEngine | None = None
        self.attr: str | None = None
        self.adapter = CallAdapter()
        self._step: _Step | None = None

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], mode: str) -> StepOutcome:
        assert mode in MODES and self.module is not None and self.engine is not None
        batch, rest = args[0], args[1:]
        rows = torch.arange(batch_size(batch))  # row indices stay on the host
        self._step = _Step(fn, batch, rest, mode)
        micro = self.engine.config.num_microbatches
        assert micro is not None
        self.adapter.microbatches = (
            micro if mode == "train" else eval_microbatches(len(rows), micro)
        )
        # Every rank passes the inputs: the engine gives them to the stages that need them.
        inputs, kw = self.capture(lambda: fn(batch, *rest))
        grads = None
        with self.recorder.recording(self.module, self.engine):
            if mode == "train":
                loss, grads = self.engine.train_step_deferred(*inputs, target=rows, **kw)
            else:
                loss = self.engine.eval_step(*inputs, target=rows, **kw)
        step, self._step = self._step, None
        extra = {"skipped": step.skipped, "predictions": _merge(step.outputs)}
        extra = self.recorder.replay(self.module, self.engine, extra)
        self.recorder.finish(self.module)
        flag = extra["skipped"].clone()  # one element, on the device
        if mode == "train":  # a skip anywhere is a skip everywhere: the update is one update
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return StepOutcome(loss, bool(flag.item()), extra["predictions"], grads)

    def capture(self, run: Callable[[], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Run the user's code until it calls the network; return what it passed to it."""

        def capture(*args: Any, **kwargs: Any) -> Any:
            raise Captured(args, kwargs)

        assert self.module is not None
        with self.redirected(capture), self.recorder.muted(self.module):
            try:
                run()
            except Captured as got:
                return self.adapter.stage_inputs(got.args, got.kwargs)
        raise RuntimeError(
            f"the step never called the network (self.{self.attr}(...), directly or through "
            "self(...)); ZeroPPStrategy feeds the pipeline with what the step passes to it."
        )

    def scheduled_loss(self, output: Any, rows: torch.Tensor) -> torch.Tensor:
        """The user's step on one micro-batch, with the network's output already computed."""
        step = self._step
        assert step is not None

        def returned(*args: Any, **kwargs: Any) -> Any:
            return self.adapter.stage_output(output, args, kwargs)

        with self.redirected(returned), self.recorder.microbatch():
            result = step.fn(take_rows(step.batch, rows), *step.rest)
        if step.mode == "predict":
            step.outputs.append(result)
            return _zero(output, grad=False)
        if step.mode == "eval":
            loss = result.get("loss") if isinstance(result, dict) else result
            scalar = torch.is_tensor(loss) and loss.numel() == 1
            return _scalar(loss) if scalar else _zero(output, grad=False)
        return self._training_loss(result, output)

    def probe_loss(self, output: Any, rows: torch.Tensor) -> torch.Tensor:
        """The runtime's shape-inference call: same computation, nothing logged or kept."""
        assert self.module is not None and self._step is not None
        outputs, skipped = list(self._step.outputs), self._step.skipped
        with self.recorder.muted(self.module):
            loss = self.scheduled_loss(output, rows)
        self._step.outputs, self._step.skipped = outputs, skipped
        return loss

    def _training_loss(self, result: Any, output: Any) -> torch.Tensor:
        assert self._step is not None
        if result is None:  # Lightning: skip this batch (here: on every rank)
            self._step.skipped = True
            return _zero(output, grad=True)
        loss = result
        if isinstance(result, dict):
            if "loss" not in result:
                raise ValueError(
                    f"training_step returned a dict without 'loss' (keys {sorted(result)}); "
                    "return the loss tensor, or a dict with it under 'loss'."
                )
            loss = result["loss"]
        if not torch.is_tensor(loss) or loss.numel() != 1 or not loss.requires_grad:
            if not torch.is_tensor(loss):
                what = f"{loss!r} ({type(loss).__name__})"
            elif loss.numel() != 1:
                what = f"a tensor of shape {tuple(loss.shape)}"
            else:
                what = "a tensor that does not require grad"
            raise ValueError(
                f"training_step returned {what} as its loss; return a scalar tensor computed "
                "from the model's output (e.g. loss.mean())."
            )
        return _scalar(loss)

    @contextlib.contextmanager
    def redirected(self, fn: Callable[..., Any]) -> Iterator[None]:
        """Only the network is stood in for: the module's own forward runs as written."""
        module, attr = self.module, self.attr
        assert module is not None and attr is not None
        real = module._modules[attr]
        module._modules[attr] = StandIn(fn, attr)
        try:
            yield
        finally:
            module._modules[attr] = real


def _scalar(loss: torch.Tensor) -> torch.Tensor:
    """A one-element loss as a 0-d tensor that is not a view (the zero-bubble schedules detach
    the last stage's loss in place, which views refuse)."""
    return loss if loss.dim() == 0 else loss.sum()


def _zero(output: Any, grad: bool) -> torch.Tensor:
    """A zero loss on the output's device; with `grad`, one backward can run through."""
    tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t)]
    if grad:
        return sum((t.sum() * 0.0 for t in tensors if t.requires_grad), torch.zeros(()))
    return torch.zeros((), device=tensors[0].device if tensors else "cpu")


def _merge(outputs: list[Any]) -> Any:
    """Per-micro-batch predictions as one batch: tensors concatenated along rows, else a list."""
    if not outputs:
        return None
    if all(torch.is_tensor(o) and o.dim() > 0 for o in outputs):
        return torch.cat(outputs)
    if all(isinstance(o, dict) for o in outputs):
        keys = outputs[0].keys()
        return {k: _merge([o[k] for o in outputs]) for k in keys}
    return [x for o in outputs for x in (o if isinstance(o, list) else [o])]
