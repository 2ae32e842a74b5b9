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

from lightning_zeropp.core.engine_build import (
    block_plan,
    build_stages,
    rank_describer,
    settle_split,
)
from lightning_zeropp.core.engine_context import EngineContext
from lightning_zeropp.core.engine_reports import EngineReports
from lightning_zeropp.core.engine_schedules import Schedules
from lightning_zeropp.core.measure.planning import PlanningStats
from lightning_zeropp.core.mesh import ParallelDims, build_mesh
from lightning_zeropp.core.settings.env import check_batch_from_env
from lightning_zeropp.core.settings.layout import ZeroPPLayout, check_layout
from lightning_zeropp.core.settings.placement import (
    rank_of_stage,
    schedule_style,
    stage_ids_for_rank,
)
from lightning_zeropp.core.split.methods import SplitMethod, resolve_split
from lightning_zeropp.core.split.outputs import restore_output
from lightning_zeropp.core.step.agree import agree, check_replicas, model_layout, settings_fields
from lightning_zeropp.core.step.batch import ShapeGuard
from lightning_zeropp.core.step.chunked_loss import chunk_for_run, set_loss_chunk
from lightning_zeropp.core.step.failure import FailureBoard, describe_rank, guarded
from lightning_zeropp.core.step.grads import StepGrads, average_whole_grads, clip_grad_norm_
from lightning_zeropp.core.step.loss import LossFn, StepLoss, broadcast_loss
from lightning_zeropp.core.step.nonfinite import NonFiniteWatch
from lightning_zeropp.core.step.pipeline_batch import BatchSharer
from lightning_zeropp.core.weights.materialize import InitFn, has_meta

__all__ = ["ZeroPPEngine", "LossFn"]


class ZeroPPEngine:
    """This rank's pipeline stages of `model`, sharded, and the schedule that runs them.

    Args:
        model: the whole model, unmodified: built as usual, or with its parameters on the meta
            device (`empty_parameters()`, Accelerate's `init_empty_weights()`), in which case
            each rank allocates its own shards only, filled from `load_from` or by `init`.
        layout: layout and schedule, resolved already for this world: a `ZeroPPLayout`, as a
            front's door resolves it (`launch_layout(config)` in plain PyTorch code). The engine
            resolves nothing and reads no launcher variable.
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
        layout: ZeroPPLayout,
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
        self.config = cfg = check_layout(layout, dist.get_world_size())
        self.device = device or torch.device("cpu")
        self.num_stages = cfg.num_stages
        self._meta = has_meta(model)
        self.plan = block_plan(model, cfg, example_args, example_kwargs)
        self.split = resolve_split(model, split)
        # Setup communicates: a rank failing or lost in it is named on every rank (the board
        # guards this constructor), and ranks that would build other layouts stop here.
        self.failures = FailureBoard.of_process()
        check = check_batch_from_env()  # a collective per step: every rank's must agree
        agree(
            settings_fields(
                cfg, split=self.split, check_batch=check, **model_layout(model, self.plan)
            )
        )
        self._context: EngineContext | None = None
        if cfg.cp_size > 1:  # refused on every rank alike, before the mesh's collectives
            self._context = EngineContext(cfg.cp_size, model)
            example_args, example_kwargs = self._context.example(example_args, example_kwargs)
        self.dims: ParallelDims = dims or build_mesh(cfg, self.device.type, self.device)
        self._attention = self._context.bind(self.dims) if self._context is not None else None
        # Every stage of a pipeline steps on its first stage's batch (random collators).
        pp = self.dims.pp_group if cfg.pp_size > 1 else None
        self.batches = BatchSharer(pp, self.device, check, self.failures.guard)
        self.style = schedule_style(cfg.schedule)
        self.stage_ids = stage_ids_for_rank(
            self.style, self.dims.pp_rank, cfg.pp_size, cfg.num_chunks
        )
        self.split = settle_split(model, split, self.split, cfg, self.plan, self._meta)
        if self._context is not None:  # a traced graph keeps the example's mask form
            self._context.split.traced = self.split == "trace" and self.num_stages > 1
        # The head and the loss in chunks wherever the model's code computes its loss so. Only
        # the call split hands the last stage the call's targets (a traced or pruned stage
        # takes activations): under the others, models compute their loss from whole logits.
        # Under context parallelism a loss the model computes itself would cover this rank's
        # part of the sequence only: whole logits, which a front gathers (`whole_sequences`).
        # An explicit `loss_chunk` where the run cannot chunk is refused (the same on every rank).
        set_loss_chunk(chunk_for_run(cfg.loss_chunk, self.split, self.num_stages, cfg.cp_size))
        built = build_stages(
            model, cfg, self.plan, self.stage_ids, self.split, self.dims, self.device,
            self._meta, example_args, example_kwargs, init, load_from, self._attention,
        )  # fmt: skip
        self._call_inputs, self._plus, self._tied = built.call_inputs, built.plus, built.tied
        self.offload = built.offload  # what the activation offload moved to host (or None)
        self.module: nn.Module = built.module
        self._stage_modules = built.modules
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
        self._loss = StepLoss(loss_fn, probe_loss_fn or loss_fn, self.restore_output)
        self._schedules = Schedules(
            cfg, self.dims, self.stage_ids, self._stage_modules, self.device, self.failures,
            self._loss, self.planning, self._shapes,
        )  # fmt: skip
        if self._attention is not None:
            self._schedules.inference_context = self._attention.paused
        # A failure inside a step (say the loss raising on the last stage) becomes, on every
        # rank, an error naming the failing rank and its error, instead of transport errors.
        describe = rank_describer(self.dims.mesh, self.style, cfg)
        self.failures.describe(describe_rank(self.dims.mesh, self.stage_ids), describe)
        self._replicas_checked = False  # at the first step: after a checkpoint was loaded
        self.nonfinite = NonFiniteWatch(
            self._stage_modules, self.stage_ids, self.num_stages, self.device, cfg.nonfinite
        )
        # What the engine reports besides the loss; the training step records into it.
        self.reports = EngineReports(self.dims, self.device, self.module, self.offload, count_comms)

    # ------------------------------------------------------------------ set-up
    def _check_replicas_once(self) -> None:
        """Before the first step (after any checkpoint was loaded): replicas start alike."""
        if not self._replicas_checked:
            group = None
            if self.config.dp_replicate_size > 1:
                group = self.dims.mesh.get_group("dp_replicate")
            with self.failures.guard():
                check_replicas(self.module.named_parameters(), group)
            self._replicas_checked = True

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
        args, kwargs, target, problem = self._split_context(args, kwargs, target, skip)
        schedule = self._schedule_for("train", args, kwargs, target, skip, problem=problem)
        if schedule is None:
            return torch.zeros((), device=self.device), StepGrads(())
        earlier = StepGrads(self.parameters())  # the runtime divides every .grad present
        losses: list[torch.Tensor] = []
        inputs, kw = self._stage_inputs(args, kwargs)
        # Collectives counted; the first step measures the peaks of the memory report.
        measures = self.reports.step_measures(self._stage_modules)
        self.nonfinite.start()
        with self.failures.guard(), measures:
            with self._attention or contextlib.nullcontext():
                schedule.step(*inputs, target=target, losses=losses, return_outputs=False, **kw)
            if measures.first and self._attention is not None:
                self._attention.check_taken(self.device)
            # This step's gradients only: `earlier` holds earlier accumulation steps' ones.
            average_whole_grads(self.parameters(), self.dims.grad_groups, self.dims.grad_size)
            self._tied.sum_grads()
            loss = self._broadcast_loss(losses)
        if self.nonfinite.check(loss):  # the same loss on every rank: all skip, or all raise
            for p in self.parameters():
                p.grad = None
        grads = StepGrads(self.parameters())
        earlier.apply()
        self.reports.record(measures)
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
        args, kwargs, target, problem = self._split_context(args, kwargs, target, skip)
        schedule = self._schedule_for(
            "eval", args, kwargs, target, skip, microbatches, problem=problem
        )
        if schedule is None:
            return None
        losses: list[torch.Tensor] = []
        inputs, kw = self._stage_inputs(args, kwargs)
        with self.failures.guard(), self._attention or contextlib.nullcontext():
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

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    # ------------------------------------------------------------------ reports (`self.reports`)
    @property
    def count_comms(self) -> bool:
        """Whether every training step's collectives are counted (`last_comms`, `comm_metrics`)."""
        return self.reports.count_comms

    @count_comms.setter
    def count_comms(self, on: bool) -> None:
        self.reports.count_comms = on

    @property
    def last_comms(self) -> dict[str, dict[str, dict[str, int]]] | None:
        """{kind: {axis: {"count", "bytes"}}} of the last train_step, when count_comms is on."""
        return self.reports.last_comms

    @property
    def gathered_peak(self) -> int | None:
        """The most unsharded weight bytes this rank held at once in its first training step."""
        return self.reports.gathered_peak

    @property
    def activation_peak(self) -> int | None:
        """The most bytes saved for backward at once (weights excluded) in the first step."""
        return self.reports.activation_peak

    @property
    def host_activation_peak(self) -> int | None:
        """`EngineReports.host_activation_peak`: saved-activation bytes held in host memory."""
        return self.reports.host_activation_peak

    def comm_metrics(self, prefix: str = "comm") -> dict[str, float]:
        """`EngineReports.comm_metrics`: the last step's collectives as flat metrics (collective)."""
        return self.reports.comm_metrics(prefix)

    def memory_report(
        self, optimizers: Sequence[torch.optim.Optimizer] = (), title: str = "now"
    ) -> str:
        """`EngineReports.memory_report`: every rank's memory, one line each (collective)."""
        return self.reports.memory_report(optimizers, title)

    def report_memory_after_first_update(
        self, optimizers: Sequence[torch.optim.Optimizer], emit: Callable[[str], None]
    ) -> None:
        """`EngineReports.report_memory_after_first_update`: `emit` the memory report once."""
        self.reports.report_memory_after_first_update(optimizers, emit)

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
        problem: ValueError | None = None,
    ) -> Any:
        """The schedule for this batch's shapes, after the batch checks, built on first use on
        every rank alike (`Schedules.for_batch`); None when the step is skipped (on every
        rank). Replicas are compared before the first step. `problem`: this rank's batch was
        already found bad (raised on every rank)."""
        self._check_replicas_once()
        entry = self._schedules.for_batch(mode, args, kwargs, target, skip, chosen, problem)
        if entry is None:
            return None
        if mode == "train":
            self.stages = entry[1]
        return entry[0]

    def _split_context(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, skip: bool
    ) -> tuple[tuple[Any, ...], dict[str, Any], Any, ValueError | None]:
        """This CP rank's part of the batch (`EngineContext.batch`), or the batch as given."""
        if self._context is None or skip:
            return args, kwargs, target, None
        return self._context.batch(args, kwargs, target)

    def whole_sequences(self, output: Any) -> Any:
        """The last stage's `output` for one micro-batch with each tensor of this CP rank's
        part of the sequence (dim 1) gathered into whole sequences in order, as one process
        computes them (`core.step.context_attention.whole_sequences`; a front's loss from it
        is then the same on every CP rank); `output` itself without context parallelism."""
        return output if self._context is None else self._context.whole_sequences(output)

    def restore_output(self, output: Any) -> Any:
        """The last stage's output as the model returns it (an HF `ModelOutput`, a dict), from
        the tensors the pipeline runtime passes around."""
        if self.num_stages - 1 not in self.stage_ids:
            return output
        last = self._stage_modules[self.stage_ids.index(self.num_stages - 1)]
        return restore_output(last, output)

    def _broadcast_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        dims = self.dims
        return broadcast_loss(
            losses, self.device, dims.pp_group, self.config.pp_size, self.last_pp_rank,
            dims.grad_groups, dims.grad_size,
        )  # fmt: skip
