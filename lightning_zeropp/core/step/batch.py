"""Batch helpers: the batch size of a nested batch, slicing it by row indices, the checks every
rank makes of its own batch, and the step's agreement over them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_zeropp.core._torch_private import default_store, tree_flatten, tree_map
from lightning_zeropp.core.mesh import world_timeout
from lightning_zeropp.core.schedule.build import eval_microbatches
from lightning_zeropp.core.step.failure import raised_everywhere
from lightning_zeropp.core.step.preempt import Preemption
from lightning_zeropp.core.step.store import BoundedStore, store_deadline_s

__all__ = [
    "ShapeGuard",
    "agree_on_step",
    "batch_size",
    "take_rows",
    "check_batch",
    "check_divisible",
    "shape_key",
    "step_microbatches",
]

_REASON = "lightning_zeropp/batch_check"  # /{rank}: why that rank's batch failed its checks


def batch_size(batch: Any) -> int:
    """Leading dimension of the first tensor in a nested batch (tuples, lists, dicts)."""
    leaves, _ = tree_flatten(batch)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    raise ValueError("the batch holds no tensor with a batch dimension")


def take_rows(batch: Any, rows: torch.Tensor) -> Any:
    """The same nested batch holding only `rows` (a contiguous index range) of every tensor."""
    start, stop = int(rows[0]), int(rows[-1]) + 1
    return tree_map(lambda x: x[start:stop] if _is_batched(x) else x, batch)


def check_divisible(size: int, num_microbatches: int) -> None:
    """Micro-batches must be equal, or the mean of micro-batch means is not the batch mean."""
    if size % num_microbatches != 0:
        raise ValueError(
            f"a batch of {size} rows does not split into num_microbatches={num_microbatches} equal "
            f"micro-batches; use a per-rank batch size that is a multiple of {num_microbatches} "
            "(and drop_last=True in the data loader)."
        )


def check_batch(
    mode: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    target: Any,
    shapes: ShapeGuard | None = None,
) -> int:
    """Checks every rank makes from its own arguments, before any communication; returns the
    batch's rows. `shapes`: the guard of stages specialised to an example's shapes (traced)."""
    present = [x for x in (args or None, kwargs or None, target) if x is not None]
    if not present:
        raise ValueError(
            "train_step / eval_step got no batch: every rank passes the same batch (the "
            "model inputs, and target=)."
        )
    if shapes is not None:  # traced stages are specialised to the example's shapes
        shapes.check(mode, args, kwargs, present)
    rows = batch_size(present)
    if target is not None and (args or kwargs) and batch_size(target) != rows:
        # The schedule would cut them into micro-batches of other rows: the loss would pair
        # outputs with other rows' targets, or fail on the last stage only.
        raise ValueError(
            f"target= has {batch_size(target)} rows and the model inputs {rows}; pass the "
            "targets of the same rows (the same batch, split the same way)."
        )
    return rows


def step_microbatches(mode: str, rows: int, configured: int, chosen: int | None = None) -> int:
    """How many micro-batches a step of `rows` runs in: `configured` for training (which must
    divide the rows); for evaluation `chosen` (checked alike), else as many equal ones as divide
    the rows (at most `configured`: `eval_microbatches`)."""
    if mode == "train":
        check_divisible(rows, configured)
        return configured
    if chosen is not None:
        check_divisible(rows, chosen)
        return chosen
    return eval_microbatches(rows, configured)


def shape_key(batch: Any) -> tuple[Any, ...]:
    """The shapes and dtypes of a nested batch's tensors (what pipeline stages fix at first run)."""
    leaves, _ = tree_flatten(batch)
    return tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor))


def _is_batched(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() > 0


class ShapeGuard:
    """Traced stages (split='trace') fix their tensor shapes to the example micro-batch and to
    the first batch of each mode (train / eval): a batch of other shapes must fail here, on every
    rank (each checks its own copy of the batch), before the schedule, where a mismatch on one
    stage would leave the others waiting."""

    def __init__(self, example: Any, microbatches: int) -> None:
        leaves = tree_flatten(example)[0]
        self._example = [tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)]
        self._microbatches = microbatches
        self._first: dict[str, list[tuple[int, ...]]] = {}

    def check(self, mode: str, args: Any, kwargs: Any, batch: Any) -> None:
        if mode == "train" and mode not in self._first:
            self._check_example(args, kwargs)
        leaves, _ = tree_flatten(batch)
        shapes = [tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)]
        first = self._first.setdefault(mode, shapes)
        if shapes != first:
            raise ValueError(
                f"a {mode} batch changed shape from {first} to {shapes}; stages traced with "
                "split='trace' are fixed to the example's shapes. Use split='call' (the default), "
                "or keep batch size and sequence length constant (drop_last=True, fixed padding)."
            )

    def _check_example(self, args: Any, kwargs: Any) -> None:
        """The first training batch is `microbatches` example micro-batches."""
        mb, example = self._microbatches, self._example
        want = [(s[0] * mb, *s[1:]) if s else s for s in example]
        leaves = tree_flatten((args, kwargs))[0]
        got = [tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)]
        if got != want:
            raise ValueError(
                f"split='trace' fixed the stages to the example micro-batch's shapes {example}, "
                f"so a training batch of num_microbatches={mb} micro-batches has {want}; this "
                f"one has {got}. Give an example of one micro-batch of these batches "
                "(example_args / example_input_array), or use split='call' (any shape)."
            )


def agree_on_step(
    cached: bool,
    problem: ValueError | None,
    description: str,
    device: torch.device,
    guard: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    skip: bool = False,
) -> tuple[bool, bool]:
    """One small all-reduce over the world before a step: whether every rank has the schedule
    for its batch's shapes cached (else all build one: see `ZeroPPEngine._schedule_for`),
    whether every rank's batch passed its checks, whether some rank skips the step (a
    front's step that returned before it produced its inputs): then every rank skips it, and
    whether some rank received SIGTERM: then every rank raises `PreemptedError` here, before
    any enters the schedule (`core.step.preempt`).

    Data-parallel ranks read different batches, so one may fail a check the others pass. Then
    every rank raises, before any enters the schedule: the failing rank its own error, the
    others a ValueError naming it and its error (read from the c10d store, where it wrote the
    error before the all-reduce). The groups stay usable, as after a check all ranks fail.
    `guard` wraps the all-reduce alone (a failure board's: a peer lost there is named).
    Returns (cached everywhere, skipped somewhere).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if problem is not None:
        _store().set(f"{_REASON}/{rank}", f"{description}: {problem}")
    preemption = Preemption.of_process()
    flags = torch.tensor(
        [
            int(cached),
            rank if problem is not None else world,
            int(not skip),
            preemption.flag(rank, world),
        ],
        dtype=torch.int32,
        device=device,
    )
    with guard():
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    cached_everywhere, first, stepping, signalled = flags.tolist()
    if (stop := preemption.stopped(signalled, world)) is not None:
        raise stop  # a SystemExit: no failure board records it, the groups stay usable
    if first < world:
        if problem is not None:
            raise raised_everywhere(problem)
        reason = _store().get(f"{_REASON}/{first}").decode()
        raise raised_everywhere(
            ValueError(f"{reason} (this rank's batch passed; every rank stops at this step)")
        )
    return bool(cached_everywhere), not stepping


def _store() -> BoundedStore:
    """The default store, each call with a deadline (`core.step.store`)."""
    return BoundedStore(default_store(), store_deadline_s(world_timeout()))
