"""A user's Lightning step run through the pipeline, as gradient accumulation runs it.

A batch is cut into micro-batches; the user's step runs once per micro-batch, on every rank, in a
`Continuation`: up to its network call (masking, counting, logging: once per micro-batch), which
hands the pipeline that micro-batch's inputs. The engine runs the schedule; on the last stage the
loss of micro-batch m is the rest of micro-batch m's step, continued with the network's output, so
the loss sees exactly what the step computed before the call (the random draws included). Other
ranks end their steps at the network call. Every rank steps on the first stage's batch, and the
random generators of a pipeline's ranks are made equal before each step, so every rank draws what
the first stage drew. What only the last stage
learns (logged values, a skipped batch, predictions, the extra keys of a returned dict, the loss's
weight) is sent to every stage with the logged values, so every rank acts alike.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_zeropp.core._torch_private import tree_map
from lightning_zeropp.core.engine import ZeroPPEngine
from lightning_zeropp.core.step.batch import batch_size, take_rows
from lightning_zeropp.core.step.grads import StepGrads
from lightning_zeropp.fronts.call_adapter import CallAdapter
from lightning_zeropp.fronts.microbatches import call_microbatches, loss_shares, rows_split
from lightning_zeropp.lightning.continuation import Continuation
from lightning_zeropp.lightning.logging import LogRecorder
from lightning_zeropp.lightning.microbatches import (
    check_loss,
    concat_calls,
    detached,
    merge,
    scalar,
    sync_random_state,
    zero,
)
from lightning_zeropp.lightning.network import Network
from lightning_zeropp.lightning.weighting import NUM_ITEMS, WeightWatch, loss_weight

__all__ = ["StepOutcome", "StepRunner"]

MODES = ("train", "eval", "predict")


@dataclass
class StepOutcome:
    loss: torch.Tensor
    skipped: bool = False  # some micro-batch's step returned None (on any rank)
    predictions: Any = None
    grads: StepGrads | None = None  # a training step's, held for Lightning's backward
    grad_scale: torch.Tensor | float = 1.0  # what `grads` are worth (a weighted loss's 1/weight)
    extras: dict[str, Any] = field(default_factory=dict)  # a returned dict's other keys


@dataclass
class _Step:
    mode: str
    parts: list[torch.Tensor]  # each micro-batch's rows
    steps: list[Continuation] = field(default_factory=list)
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    watches: list[WeightWatch] = field(default_factory=list)
    skipped: bool = False
    outputs: list[Any] = field(default_factory=list)  # predictions, or extra returned keys
    weights: list[torch.Tensor | None] = field(default_factory=list)


class StepRunner:
    """Runs user steps through `engine` with the module's `network` stood in for."""

    def __init__(self) -> None:
        self.recorder = LogRecorder()
        self.module: pl.LightningModule | None = None
        self.engine: ZeroPPEngine | None = None
        self.network: Network | None = None
        self.adapter = CallAdapter()
        self.weighted: bool | None = None  # whether the last training step's loss was weighted
        self._step: _Step | None = None
        self._local = threading.local()  # the network call of the step running in this thread

    # ------------------------------------------------------------------ a step
    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], mode: str) -> StepOutcome:
        assert mode in MODES and self.module is not None and self.engine is not None
        engine, module = self.engine, self.module
        batch, rest = args[0], args[1:]
        rows = batch_size(batch)
        micro = call_microbatches(rows, engine.config.num_microbatches, mode == "train")
        if not rows_split(rows, micro):  # one step for the whole batch: the engine refuses it
            micro = 1
        step = self._step = _Step(mode, list(torch.arange(rows).tensor_split(micro)))
        last = engine.dims.pp_rank == engine.last_pp_rank
        # The first stage's batch (what the loader's collation or a transfer hook drew on each
        # rank), written into this rank's: the step and the hooks after it see it.
        batch = engine.batches.share(batch)
        engine.batches.check(batch, "the batch")
        sync_random_state(engine)
        try:
            with self._redirected(), self.recorder.recording(module, engine):
                with self.recorder.muted(module) if not last else contextlib.nullcontext():
                    early = self._start(fn, batch, rest, step)
                calls = {
                    f"micro-batch {m}": {"args": a, "kwargs": k}
                    for m, (a, k) in enumerate(step.calls)
                }
                engine.batches.check(calls, "what the step passed to the network", root="step")
                if not last:  # their losses are the last stage's: what they hold can go now
                    for continuation in step.steps:
                        continuation.abandon()
                loss, grads = self._schedule(step, early)
            outcome = self._finish(step, loss, grads, last)
        finally:
            for continuation in step.steps:
                continuation.abandon()
            self._step = None
        return outcome

    def _start(
        self, fn: Callable[..., Any], batch: Any, rest: tuple[Any, ...], step: _Step
    ) -> bool:
        """Run each micro-batch's step up to its network call; True if one returned before it."""
        early = False
        assert self.network is not None  # set up before the first step
        for rows in step.parts:
            watch = WeightWatch()
            run = functools.partial(self._micro_step, fn, take_rows(batch, rows), rest, watch)
            continuation = Continuation(run, _SECOND_CALL.format(call=self.network.call))
            step.steps.append(continuation)
            step.watches.append(watch)
            with self.recorder.microbatch(watch):
                event = continuation.start()
            if event.kind == "raise":
                raise event.value
            if event.kind == "return":
                if event.value is not None:
                    raise RuntimeError(_NEVER_CALLED.format(call=self.network.call))
                early = step.skipped = True
                continue
            step.calls.append((event.args, event.kwargs or {}))
        return early

    def _micro_step(
        self,
        fn: Callable[..., Any],
        batch: Any,
        rest: tuple[Any, ...],
        watch: WeightWatch,
        network: Callable[..., Any],
    ) -> Any:
        self._local.network = network
        with watch:
            return fn(batch, *rest)

    def _schedule(self, step: _Step, early: bool) -> tuple[torch.Tensor | None, StepGrads | None]:
        engine = self.engine
        assert engine is not None
        if early:  # a micro-batch returned None before its network call: skip, everywhere
            args, kwargs = (), dict[str, Any]()
            idle = getattr(self.adapter, "idle", None)
            if idle is not None:  # the peers count their tokens together: join with none
                idle()
        else:
            self.adapter.microbatches = len(step.parts)
            args, kwargs = self.adapter.stage_inputs(*concat_calls(step.calls))
        target = torch.arange(sum(len(p) for p in step.parts))  # row indices stay on the host
        # An HF model's own mean loss is counted while its stages run (`fronts.loss_rule`).
        counting = getattr(self.adapter, "counting", contextlib.nullcontext)
        with counting():
            if step.mode == "train":
                return engine.train_step_deferred(*args, target=target, skip=early, **kwargs)
            return engine.eval_step(*args, target=target, skip=early, **kwargs), None

    def _finish(self, step: _Step, loss: Any, grads: StepGrads | None, last: bool) -> StepOutcome:
        engine, module = self.engine, self.module
        assert engine is not None and module is not None
        train = step.mode == "train"
        all_weighted = train and step.weights and step.weights[0] is not None  # all or none
        weights = cast("list[torch.Tensor]", step.weights) if all_weighted else None
        objects = merge(step.outputs, averaged=train) if step.outputs else None
        replayed = self.recorder.replay(
            module, engine, step.skipped, objects, weights, global_weights=train
        )
        self.recorder.finish(module)
        flag = replayed.skipped.clone()  # one element, on the device
        if train:  # a skip anywhere is a skip everywhere: the update is one update
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self.weighted = replayed.weight is not None
        if loss is None:
            loss = torch.zeros((), device=engine.device)
        scale: torch.Tensor | float = 1.0
        if replayed.weight is not None:  # the micro-batches entered as loss x weight
            # under CP every CP rank's step runs on whole sequences (`GlobalTokenCount`)
            scale = loss_shares(len(step.parts), engine.dims, cp_parts=False) / replayed.weight
            loss = loss * scale
        outcome = StepOutcome(loss, bool(flag.item()), grads=grads, grad_scale=scale)
        if step.mode == "predict":
            outcome.predictions = replayed.objects
        elif train and replayed.objects is not None:
            outcome.extras = replayed.objects
        return outcome

    # ------------------------------------------------------------------ the loss
    def scheduled_loss(self, output: Any, rows: torch.Tensor) -> torch.Tensor:
        """Micro-batch `rows`'s step, continued from its network call with the network's output."""
        step = self._step
        assert step is not None
        m = next(i for i, part in enumerate(step.parts) if int(part[0]) == int(rows[0]))
        args, kwargs = step.calls[m]
        # Under context parallelism the step continues with whole sequences, on every CP rank
        # alike: it reads its targets from the batch as one process does (`whole_sequences`).
        assert self.engine is not None
        if self.engine.config.cp_size > 1:
            _check_not_a_loss(output)
            output = self.engine.whole_sequences(output)
        returned = self.adapter.stage_output(output, args, kwargs)
        with self.recorder.microbatch(step.watches[m]):
            event = step.steps[m].resume(returned)
        if event.kind == "raise":
            raise event.value
        result = event.value
        if step.mode == "predict":
            step.outputs.append(result)
            return zero(output, grad=False)
        if step.mode == "eval":
            loss: Any = result.get("loss") if isinstance(result, dict) else result
            one = torch.is_tensor(loss) and loss.numel() == 1
            return scalar(loss) if one else zero(output, grad=False)
        return self._training_loss(result, output, step, m)

    def probe_loss(self, output: Any, rows: torch.Tensor) -> torch.Tensor:
        """The runtime's shape-inference call (not a micro-batch): a zero that backward runs
        through; the user's step is not run for it."""
        return zero(output, grad=True)

    def _training_loss(self, result: Any, output: Any, step: _Step, m: int) -> torch.Tensor:
        if result is None:  # Lightning: skip this batch (here: on every rank)
            step.skipped = True
            return zero(output, grad=True)
        loss = result
        if isinstance(result, dict):
            if "loss" not in result:
                raise ValueError(
                    f"training_step returned a dict without 'loss' (keys {sorted(result)}); "
                    "return the loss tensor, or a dict with it under 'loss'."
                )
            loss = result["loss"]
            extras = {k: v for k, v in result.items() if k not in ("loss", NUM_ITEMS)}
            if extras:  # none (a loss and its count) crosses nothing: the step returns the loss
                step.outputs.append(tree_map(detached, extras))
        check_loss(loss)
        weight = loss_weight(result, loss, step.watches[m])
        if step.weights and (step.weights[0] is None) != (weight is None):
            raise ValueError(
                "training_step's loss carried a weight (num_items, or a mean F.cross_entropy / "
                "F.nll_loss) for some micro-batches of the batch and not for others; return the "
                "same kind of loss for every micro-batch."
            )
        step.weights.append(weight)
        if weight is None:
            return scalar(loss)
        step.watches[m].note(loss, weight)  # a logged loss is weighted with it
        return scalar(loss) * weight

    # ------------------------------------------------------------------ set-up
    def example(
        self, batch: Any | None, fn: Callable[..., Any] | None, forward_args: Any, micro: int
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """One micro-batch of the network's inputs, for the split: what `fn` (the running
        stage's step) passes to the network for the first micro-batch of `batch`, or what the
        module's forward passes for `forward_args` (`example_input_array`, one micro-batch).
        The step is run as a step is, but leaves no trace (no log, no metric update, no
        attribute changed, no random draw)."""
        module = self.module
        assert module is not None and self.network is not None
        if forward_args is not None:
            args = forward_args if isinstance(forward_args, (tuple, list)) else (forward_args,)
            kw = forward_args if isinstance(forward_args, dict) else {}
            run = functools.partial(_call_module, module, () if kw else tuple(args), kw)
        else:
            rows = torch.arange(max(1, batch_size(batch) // micro))
            assert fn is not None  # the caller passes a step when it has no forward_args
            run = functools.partial(_call_step, fn, take_rows(batch, rows))
        continuation = Continuation(
            self._thread_network(run), _SECOND_CALL.format(call=self.network.call)
        )
        with self._redirected():
            event = continuation.start()
            continuation.abandon()
        if event.kind == "raise":
            raise event.value
        if event.kind == "return" and event.value is None:
            raise ValueError(
                "the step returned None for the first micro-batch of the first batch before "
                f"calling the network ({self.network.call}): ZeroPPStrategy learns the network's "
                "input shapes from that call. Set example_input_array (one micro-batch of the "
                "network's inputs)."
            )
        if event.kind != "call":
            raise RuntimeError(_NEVER_CALLED.format(call=self.network.call))
        self.adapter.microbatches = 1
        return self.adapter.stage_inputs(event.args, event.kwargs or {})

    def _thread_network(self, run: Callable[[], Any]) -> Callable[[Callable[..., Any]], Any]:
        def in_thread(network: Callable[..., Any]) -> Any:
            self._local.network = network
            return run()

        return in_thread

    def _redirected(self) -> contextlib.AbstractContextManager[None]:
        assert self.network is not None
        return self.network.redirected(self._network_call)

    def _network_call(self, *args: Any, **kwargs: Any) -> Any:
        network = getattr(self._local, "network", None)
        if network is None:
            assert self.network is not None  # this is installed by the network's redirect
            raise RuntimeError(
                f"{self.network.call} was called outside a step under ZeroPPStrategy"
            )
        return network(*args, **kwargs)


_NEVER_CALLED = (
    "the step never called the network ({call}, directly or through self(...)); ZeroPPStrategy "
    "feeds the pipeline with what the step passes to it. Return None to skip a batch."
)
_SECOND_CALL = (
    "the step called the network ({call}) more than once for one micro-batch. Under "
    "ZeroPPStrategy the pipeline runs the network once per micro-batch and the step receives "
    "that output; call it once per step, or put both calls inside the network's own forward."
)


def _check_not_a_loss(output: Any) -> None:
    """Under context parallelism the network runs on each CP rank's part of the sequence: a
    loss it computes itself (a scalar output) would cover that part only."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        raise ValueError(
            "under context parallelism (cp_size > 1) the network returned a scalar (a loss it "
            "computed itself, e.g. model(x, targets=y)): it would cover this rank's part of each "
            "sequence only. Return the logits from the network and compute the loss in the step "
            "(the step sees whole sequences), or set cp_size=1."
        )


def _call_step(fn: Callable[..., Any], batch: Any) -> Any:
    return fn(batch, 0)


def _call_module(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return module(*args, **kwargs)
