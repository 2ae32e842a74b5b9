"""One training step of a model pipelined over FSDP2: micro-batches in, loss out, gradients ready.

`ZeroPPEngine` is the whole core seen from a front: it splits the model into this rank's stages,
shards each stage over the data-parallel mesh, and drives torch's pipeline schedule. Every rank of
the world calls `train_step` with the same arguments (all stages of one pipeline see the same batch;
only the first stage feeds it to the model, only the last computes the loss), and every rank gets
the step's mean loss back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lightning_zeropp.core._torch_private import on_scheduled_loss
from lightning_zeropp.core.measure.comm import (
    PLUS_AXES,
    CommCounter,
    flatten_summary,
    mesh_axis_namer,
)
from lightning_zeropp.core.measure.memory import (
    GatheredPeak,
    SavedActivations,
    format_report,
    measure,
)
from lightning_zeropp.core.measure.planning import PlanningStats
from lightning_zeropp.core.mesh import ParallelDims, build_mesh, mesh_coordinates
from lightning_zeropp.core.schedule.build import (
    build_eval_schedule,
    build_schedule,
    eval_microbatches,
)
from lightning_zeropp.core.schedule.runtime import LeanStage
from lightning_zeropp.core.settings.config import ZeroPPConfig, ZeroPPLayout
from lightning_zeropp.core.settings.merge import launcher_node_size
from lightning_zeropp.core.settings.placement import (
    rank_of_stage,
    schedule_style,
    splits_backward,
    stage_ids_for_rank,
)
from lightning_zeropp.core.shard.compile import compile_blocks
from lightning_zeropp.core.shard.fsdp import apply_activation_checkpointing, shard_stage
from lightning_zeropp.core.shard.plus import Plus
from lightning_zeropp.core.split.blocks import BlockPlan, find_blocks, plan_blocks
from lightning_zeropp.core.split.call_plan import CallInputs
from lightning_zeropp.core.split.call_stages import flatten_outputs, restore_output
from lightning_zeropp.core.split.methods import (
    SplitMethod,
    check_no_tied_parameters,
    resolve_split,
    split_model,
)
from lightning_zeropp.core.split.modules import merge_stage_modules
from lightning_zeropp.core.split.tied import TiedWeights, tied_groups
from lightning_zeropp.core.step.agree import agree, check_replicas, model_layout, settings_fields
from lightning_zeropp.core.step.batch import (
    ShapeGuard,
    agree_on_step,
    batch_size,
    check_divisible,
    shape_key,
)
from lightning_zeropp.core.step.failure import FailureBoard, describe_rank, guarded
from lightning_zeropp.core.step.grads import StepGrads, average_whole_grads, clip_grad_norm_
from lightning_zeropp.core.step.nonfinite import NonFiniteWatch
from lightning_zeropp.core.weights.materialize import (
    InitFn,
    Source,
    default_init,
    fill_values,
    has_meta,
    real_to,
)

__all__ = ["ZeroPPEngine", "LossFn"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]

# Schedules kept per (mode, micro-batches, input shapes): each fixes its stages' buffer shapes when
# first run, so a batch of new shapes gets its own (and the least recently used one goes).
_MAX_SCHEDULES = 8


class ZeroPPEngine:
    """This rank's pipeline stages of `model`, sharded, and the schedule that runs them.

    Args:
        model: the whole model, unmodified: built as usual, or with its parameters on the meta
            device (`empty_parameters()`, Accelerate's `init_empty_weights()`), in which case
            each rank allocates its own shards only, filled from `load_from` or by `init`.
        config: layout and schedule; resolved against the world size here.
        loss_fn: `loss_fn(output, target_microbatch) -> scalar`, the mean over the micro-batch.
        split: "auto" (default: "call" unless the model names another), "call", "trace",
            "stack", or a callable; see `core.split`.
        example_args / example_kwargs: one micro-batch of model inputs, for split="call" (its
            check runs on the meta device: only shapes and dtypes matter) and "trace".
        probe_loss_fn: used instead of `loss_fn` for the runtime's shape-inference call, which is
            not a training micro-batch (defaults to `loss_fn`); give one without side effects.
        device: where the stages run (default: CPU).
        dims: an existing mesh for this config (default: build one).
        count_comms: record every training step's collectives (`last_comms`, `comm_metrics`).
        init: `init(module)` per module for a meta-device model (default: the model's own
            `_init_weights`, else `reset_parameters()`); see `core.weights.materialize`.
        load_from: a distributed checkpoint or a safetensors file / directory to read this
            rank's shards from (`core.weights.load`), after sharding; the whole model is never read.
    """

    @guarded
    def __init__(
        self,
        model: nn.Module,
        config: ZeroPPConfig | ZeroPPLayout,
        *,
        loss_fn: LossFn,
        split: SplitMethod = "auto",
        example_args: tuple[Any, ...] | None = None,
        example_kwargs: dict[str, Any] | None = None,
        probe_loss_fn: LossFn | None = None,
        device: torch.device | None = None,
        dims: ParallelDims | None = None,
        count_comms: bool = False,
        init: InitFn | None = None,
        load_from: str | Path | None = None,
    ) -> None:
        self.config = config.resolve(dist.get_world_size(), launcher_node_size())
        cfg = self.config
        self.device = device or torch.device("cpu")
        self.num_stages = cfg.num_stages
        self._meta = has_meta(model)
        self.plan = _plan(model, self.num_stages, cfg.split_points)
        self.split = resolve_split(model, split)
        # Setup communicates: a rank failing or lost in it is named on every rank (the board
        # guards this constructor), and ranks that would build other layouts stop here.
        self.failures = FailureBoard.of_process()
        agree(settings_fields(cfg, split=self.split, **model_layout(model, self.plan)))
        self.dims: ParallelDims = dims or build_mesh(cfg, self.device.type)
        self.style = schedule_style(cfg.schedule)
        self.stage_ids = stage_ids_for_rank(
            self.style, self.dims.pp_rank, cfg.pp_size, cfg.num_chunks
        )
        if cfg.compile and self.plan is None:
            raise ValueError(
                f"compile=True compiles each block of the model, but {type(model).__name__} has "
                "no blocks (a ModuleList, ModuleDict or nn.Sequential of at least 2 layers); "
                "compile the model yourself (torch.compile) and leave compile=False."
            )
        if self._meta and self.split == "trace" and self.num_stages > 1:
            # Tracing records the device of every value: a meta model's graph runs on meta.
            if split != "auto":
                raise ValueError(
                    "split='trace' cannot cut a model whose parameters are on the meta device "
                    "(the traced graph would keep running on it); use split='call' (the "
                    "default), or build the model with its weights."
                )
            self.split = "call"  # the model prefers tracing; its meta build rules it out
        if self.split == "trace" and split == "auto" and _recast(model, cfg.param_dtype):
            # A traced graph keeps the dtypes it was traced in: a cast to float32 that was a
            # no-op then (HF's norms) is recorded as a check, and fails on bf16 activations
            # (an explicit split="trace" is checked for such casts once traced).
            self.split = "call"  # the model prefers tracing; mixed precision rules it out
        # Tied weights get a copy per stage under split="call" / "stack" (see core.tied).
        tied = tied_groups(model) if self.num_stages > 1 else []
        if self.num_stages > 1 and self.split not in ("call", "stack"):
            check_no_tied_parameters(model)
        # split="call" stages take the model inputs on every rank (see core.call_split).
        self._call_inputs = CallInputs() if self.split == "call" and self.num_stages > 1 else None
        modules = split_model(
            model,
            self.plan,
            self.stage_ids,
            self.split,
            example_args,
            example_kwargs,
            call_inputs=self._call_inputs,
            device=self.device,
            dtype=cfg.param_dtype,
        )
        if self.num_stages == 1:
            flatten_outputs(modules[0])  # call stages flatten their own outputs
        self._plus = Plus.build(self.dims.mesh, cfg)  # ZeRO++'s groups: every rank, in one order
        for stage_id, module in zip(self.stage_ids, modules, strict=True):
            self._prepare_stage(module, stage_id)
        self._tied = TiedWeights(tied, list(zip(self.stage_ids, modules, strict=True)), self.dims)
        self.module: nn.Module = merge_stage_modules(modules)
        if self._meta or load_from is not None:
            source = Source(init or default_init(model), load_from, model, init is not None)
            fill_values(modules, self.module, self.device, self._meta, source, self._tied)
        self._stage_modules = modules
        self._loss_fn = loss_fn
        self._probe_loss_fn = probe_loss_fn or loss_fn
        self._in_scheduled_loss = False
        self._schedules: dict[tuple[Any, ...], tuple[Any, list[PipelineStage]]] = {}
        # Schedules built for new batch shapes, and the time it took (reported by the fronts).
        self.planning = PlanningStats()
        # The PipelineStages of the last training schedule run (those the next step of the same
        # shapes runs: timelines wrap them).
        self.stages: list[PipelineStage] = []
        self.holds_first = 0 in self.stage_ids
        self.last_pp_rank = rank_of_stage(self.style, self.num_stages - 1, cfg.pp_size)
        self._shapes = None
        if self.split == "trace" and self.num_stages > 1:
            example = (example_args or (), example_kwargs or {})
            self._shapes = ShapeGuard(example, cfg.num_microbatches)
        # A failure inside a step (say the loss raising on the last stage) becomes, on every
        # rank, an error naming the failing rank and its error, instead of transport errors.
        self.failures.describe(describe_rank(self.dims.mesh, self.stage_ids), self._describe)
        self._replicas_checked = False  # at the first step: after a checkpoint was loaded
        self.nonfinite = NonFiniteWatch(
            modules, self.stage_ids, self.num_stages, self.device, cfg.nonfinite
        )
        self.count_comms = count_comms
        self._axis_namer = mesh_axis_namer(self.dims.mesh)
        # {kind: {axis: {"count", "bytes"}}} of the last train_step, when count_comms is on
        self.last_comms: dict[str, dict[str, dict[str, int]]] | None = None
        self._gathered_peak: int | None = None  # measured in the first training step
        self._activation_peak: int | None = None  # the same step's

    # ------------------------------------------------------------------ set-up
    def _describe(self, rank: int) -> str:
        """Any rank's name in messages (`describe_rank`, with that rank's stages)."""
        coords = mesh_coordinates(self.dims.mesh, rank)
        stages = stage_ids_for_rank(
            self.style, coords.get("pp", 0), self.config.pp_size, self.config.num_chunks
        )
        return describe_rank(self.dims.mesh, stages, rank=rank)

    def _check_replicas_once(self) -> None:
        """Before the first step (after any checkpoint was loaded): replicas start alike."""
        if not self._replicas_checked:
            group = None
            if self.config.dp_replicate_size > 1:
                group = self.dims.mesh.get_group("dp_replicate")
            with self.failures.guard():
                check_replicas(self.module.named_parameters(), group)
            self._replicas_checked = True

    def _prepare_stage(self, module: nn.Module, stage_id: int) -> None:
        blocks = self.plan.stage_blocks(stage_id) if self.plan is not None else []
        if self._meta:
            real_to(module, self.device)  # the rest is allocated once sharded
        else:
            module.to(self.device)
        if self.config.compile:  # inside the checkpoint, outside FSDP's hooks
            cfg = self.config
            regions = splits_backward(cfg.schedule, cfg.split_backward)
            compile_blocks(module, blocks, regions=regions)
        if self.config.recomputes(stage_id):
            apply_activation_checkpointing(module, blocks)
        shard_stage(module, blocks, self.dims.dp_mesh, self.config, self._plus)

    # ------------------------------------------------------------------ steps
    def train_step(
        self, *args: Any, target: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """Forward and backward over all micro-batches of this rank's batch.

        Gradients (the mean over the global batch) are added to the parameters' `.grad`, as
        `loss.backward()` would. Returns the loss of the global batch (the mean over every
        micro-batch of every data-parallel rank) on every rank.
        """
        loss, grads = self.train_step_deferred(*args, target=target, **kwargs)
        grads.apply()
        return loss

    def train_step_deferred(
        self,
        *args: Any,
        target: torch.Tensor | None = None,
        skip: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, StepGrads]:
        """`train_step` whose gradients are held, not added to `.grad`: the front applies them
        times the scale its loop gives the loss (`StepGrads.apply`), or discards them.

        `skip=True` (no batch given): this rank skips the step; so does every rank, which then
        gets a zero loss and no gradient (a data-parallel peer may have skipped instead)."""
        schedule = self._schedule_for("train", args, kwargs, target, skip)
        if schedule is None:
            return torch.zeros((), device=self.device), StepGrads(())
        earlier = StepGrads(self.parameters())  # the runtime divides every .grad present
        losses: list[torch.Tensor] = []
        inputs, kw = self._stage_inputs(args, kwargs)
        counter = CommCounter(self._axis_namer) if self.count_comms else None
        self.nonfinite.start()
        # The first step measures the gathered-weight and activation peaks of the memory report.
        first = self._gathered_peak is None
        probe = GatheredPeak(self._stage_modules) if first else None
        saved = SavedActivations() if first else None
        with (
            self.failures.guard(),
            counter or contextlib.nullcontext(),
            probe or contextlib.nullcontext(),
            saved or contextlib.nullcontext(),
        ):
            schedule.step(*inputs, target=target, losses=losses, return_outputs=False, **kw)
            # This step's gradients only: `earlier` holds earlier accumulation steps' ones.
            average_whole_grads(self.parameters(), self.dims.dp_groups, self.dims.dp_size)
            self._tied.sum_grads()
            loss = self._broadcast_loss(losses)
        if self.nonfinite.check(loss):  # the same loss on every rank: all skip, or all raise
            for p in self.parameters():
                p.grad = None
        grads = StepGrads(self.parameters())
        earlier.apply()
        if probe is not None and saved is not None:
            self._gathered_peak, self._activation_peak = probe.peak, saved.peak
        if counter is not None:
            self.last_comms = counter.summary()
        return loss, grads

    @torch.no_grad()
    def eval_step(
        self,
        *args: Any,
        target: torch.Tensor | None = None,
        skip: bool = False,
        microbatches: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | None:
        """Forward only; returns the mean loss on every rank when `target` is given.

        Any number of rows: the batch runs in as many equal micro-batches as divide it (at most
        `num_microbatches`; `microbatches` to choose, a divisor of the rows), so the mean of
        micro-batch means is the batch mean. The loss function sees them in order. `skip`: as in
        `train_step_deferred` (returns None).
        """
        schedule = self._schedule_for("eval", args, kwargs, target, skip, microbatches)
        if schedule is None:
            return None
        losses: list[torch.Tensor] = []
        inputs, kw = self._stage_inputs(args, kwargs)
        with self.failures.guard():
            schedule.evaluate(*inputs, target=target, losses=losses, **kw)
            return self._broadcast_loss(losses) if target is not None else None

    def counted_parameters(self) -> list[nn.Parameter]:
        """This rank's parameters without the copies of tied weights that a whole-model sum (a
        norm) must not count again."""
        return self._tied.counted(self.parameters())

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        parameters: Iterable[nn.Parameter] | None = None,
    ) -> torch.Tensor:
        """Clip by the norm over every stage and shard of the model; returns that norm.

        `parameters`: this rank's part of a subset to clip (default: all); every rank passes its
        part of the same subset. A tied weight's copies count once, as its one tensor in one
        process."""
        with self.failures.guard():
            params = list(self.parameters() if parameters is None else parameters)
            counted = self._tied.counted(params)
            return clip_grad_norm_(params, max_norm, self.dims.pp_group, norm_type, counted)

    def comm_metrics(self, prefix: str = "comm") -> dict[str, float]:
        """The last training step's collectives as flat metrics, averaged over every rank.

        Keys are `{prefix}/{kind}/{axis}/count` and `.../bytes` (kinds: all_gather,
        reduce_scatter, all_reduce, broadcast, all_to_all, send and recv for point-to-point, ...;
        axes: the mesh's, "world", or ZeRO++'s `PLUS_AXES`), per rank and step; kinds and axes that never occur on any
        rank are left out. Collective: every rank must call it. Needs `count_comms=True`.
        """
        if not self.count_comms or self.last_comms is None:
            raise RuntimeError("comm_metrics needs count_comms=True and one train_step first")
        axes = [*(self.dims.mesh.mesh_dim_names or ()), "world", *PLUS_AXES, "other"]
        flat = flatten_summary(self.last_comms, axes, prefix)
        values = torch.tensor(list(flat.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(values)  # outside the counter: not part of any step's traffic
        values /= dist.get_world_size()
        return {k: float(v) for k, v in zip(flat, values.tolist(), strict=True) if v}

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    @property
    def gathered_peak(self) -> int | None:
        """The most unsharded weight bytes this rank held at once in its first training step."""
        return self._gathered_peak

    @property
    def activation_peak(self) -> int | None:
        """The most bytes saved for backward at once (weights excluded) in the first step."""
        return self._activation_peak

    def memory_report(
        self, optimizers: Sequence[torch.optim.Optimizer] = (), title: str = "now"
    ) -> str:
        """Collective: every rank's parameter, gradient and optimizer-state bytes and measured
        peaks (`core.measure.memory`), one line per rank, the same text on every rank."""
        mine = measure(
            self.module, optimizers, self.device, self._gathered_peak, self._activation_peak
        )
        return format_report(mine, title)

    def report_memory_after_first_update(
        self, optimizers: Sequence[torch.optim.Optimizer], emit: Callable[[str], None]
    ) -> None:
        """Call `emit(memory_report(...))` once, right after the first optimizer step (when
        the optimizer state exists); every rank steps its optimizers together."""
        handles: list[Any] = []

        def after_step(*_: Any) -> None:
            for handle in handles:
                handle.remove()
            emit(self.memory_report(optimizers, "after the first update"))

        handles.extend(opt.register_step_post_hook(after_step) for opt in optimizers)

    # ------------------------------------------------------------------ internals
    def _stage_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """What the schedule feeds the stages: call stages take the model inputs on every rank
        (as keywords); others take them on the first stage only."""
        if self._call_inputs is not None:
            return (), self._call_inputs.flatten(args, kwargs)
        return (args, kwargs) if self.holds_first else ((), {})

    def _schedule_for(
        self,
        mode: str,
        args: Any,
        kwargs: Any,
        target: Any,
        skip: bool = False,
        chosen: int | None = None,
    ) -> Any:
        """The schedule for this batch's shapes, after the batch checks. Built on first use;
        the least recently used one goes.

        A new schedule infers its stages' shapes with a forward that gathers the FSDP-sharded
        weights over the data-parallel ranks, so every rank must build one when any does:
        data-parallel ranks read different batches (padded to different lengths), and a rank
        that found its shapes cached would skip the gathers the others wait on. One small
        all-reduce per step decides it, and stops every rank when one rank's batch fails its
        checks (`agree_on_step`). None when the step is skipped (on every rank).
        """
        self._check_replicas_once()
        problem, microbatches, key, popped = None, 0, None, None
        if not skip:
            try:  # this rank's own checks, before any communication
                rows = self._check_batch(mode, args, kwargs, target)
                microbatches = self.config.num_microbatches
                if mode == "train":
                    check_divisible(rows, microbatches)
                elif chosen is not None:
                    check_divisible(rows, chosen)
                    microbatches = chosen
                else:
                    microbatches = eval_microbatches(rows, microbatches)
            except ValueError as err:
                problem = err
            key = (mode, microbatches, shape_key((args, kwargs, target)))
            popped = self._schedules.pop(key, None)
        entry, skipped = popped, skip
        if self.config.dp_size > 1:
            cached, skipped = agree_on_step(
                entry is not None,
                problem,
                self.failures.description,
                self.device,
                self.failures.guard,
                skip,
            )
            entry = entry if cached else None
        elif problem is not None:  # every rank has this batch: each raises this itself
            raise problem
        if skipped:
            if popped is not None:
                self._schedules[key] = popped
            return None
        if entry is None:
            if len(self._schedules) >= _MAX_SCHEDULES:
                self._schedules.pop(next(iter(self._schedules)))
                self.planning.evicted(_MAX_SCHEDULES)
            entry = self._build_schedule(mode, microbatches)
        self._schedules[key] = entry  # most recently used last
        if mode == "train":
            self.stages = entry[1]
        return entry[0]

    def _build_schedule(self, mode: str, microbatches: int) -> tuple[Any, list[PipelineStage]]:
        """A schedule over fresh stages, whose first step infers their shapes (timed in
        `planning`, with the building)."""
        with self.planning.timed():
            stages = [
                LeanStage(m, s, self.num_stages, self.device, group=self.dims.pp_group)
                for s, m in zip(self.stage_ids, self._stage_modules, strict=True)
            ]
            for stage in stages:
                stage.inference_clock = self.planning
            if mode == "train":
                schedule = build_schedule(self.config, stages, self._loss)
            else:
                schedule = build_eval_schedule(self.config, stages, self._loss, microbatches)
            on_scheduled_loss(schedule, self._scheduled_loss)
        self.planning.built()
        return schedule, stages

    def _loss(self, output: Any, target: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        fn = self._loss_fn if self._in_scheduled_loss else self._probe_loss_fn
        loss = fn(self.restore_output(output), target, **kwargs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            # On the last stage, inside the failure board's guard: every rank is told.
            what = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn returned {what}; it must return one scalar tensor, the mean loss of "
                "the micro-batch (e.g. cross_entropy with reduction='mean')."
            )
        return loss

    def restore_output(self, output: Any) -> Any:
        """The last stage's output as the model returns it (an HF `ModelOutput`, a dict), from
        the tensors the pipeline runtime passes around."""
        if self.num_stages - 1 not in self.stage_ids:
            return output
        last = self._stage_modules[self.stage_ids.index(self.num_stages - 1)]
        return restore_output(last, output)

    def _scheduled_loss(
        self, compute: Callable[..., Any], output: Any, target: Any, loss_kwargs: Any
    ) -> torch.Tensor:
        self._in_scheduled_loss = True
        try:
            return compute(output, target, loss_kwargs)
        finally:
            self._in_scheduled_loss = False

    def _check_batch(
        self, mode: str, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any
    ) -> int:
        """Checks every rank makes from its own arguments, before any communication; returns
        the batch's rows."""
        present = [x for x in (args or None, kwargs or None, target) if x is not None]
        if not present:
            raise ValueError(
                "train_step / eval_step got no batch: every rank passes the same batch (the "
                "model inputs, and target=)."
            )
        if self._shapes is not None:  # traced stages are specialised to the example's shapes
            self._shapes.check(mode, args, kwargs, present)
        rows = batch_size(present)
        if target is not None and (args or kwargs) and batch_size(target) != rows:
            # The schedule would cut them into micro-batches of other rows: the loss would pair
            # outputs with other rows' targets, or fail on the last stage only.
            raise ValueError(
                f"target= has {batch_size(target)} rows and the model inputs {rows}; pass the "
                "targets of the same rows (the same batch, split the same way)."
            )
        return rows

    def _broadcast_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        if losses:
            loss = torch.stack([x.detach().float() for x in losses]).mean().to(self.device)
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.config.pp_size > 1:
            dist.broadcast(loss, group=self.dims.pp_group, group_src=self.last_pp_rank)
        # Every dp group has its own batch: the step's loss is the mean over all of them.
        for group in self.dims.dp_groups:
            dist.all_reduce(loss, group=group)
        return loss / self.dims.dp_size


def _recast(model: nn.Module, dtype: torch.dtype | None) -> bool:
    """Whether the stages compute in another dtype than the model's floating parameters hold."""
    held = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return dtype is not None and bool(held - {dtype})


def _plan(model: nn.Module, num_stages: int, split_points: list[int] | None) -> BlockPlan | None:
    """The block plan; a single stage without a block container is sharded at its root only."""
    if num_stages == 1:
        try:
            find_blocks(model)
        except ValueError:
            return None
    return plan_blocks(model, num_stages, split_points)
