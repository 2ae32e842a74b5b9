"""The Accelerate front: `prepare_pipeline` turns an Accelerate script's objects into a pipeline.

Accelerate 1.15 has no pipeline training, and passing a pipeline stage through
`Accelerator.prepare` wraps it in DDP, which fails. So the front builds the mesh and the stages
itself (through the core's `ZeroPPEngine`) and keeps to what Accelerate does well: the process
group (torchrun / `accelerate launch`), the device, data loading (sharded over data-parallel ranks
only), gradient accumulation bookkeeping, trackers, and `save_state` / `load_state`, into which
the sharded model and optimizer checkpoint plugs through Accelerate's save/load pre-hooks.

The order of `prepare_pipeline` is the order of failure: everything a user can get wrong is
checked on every rank from its own arguments and environment before the first collective
(`accelerate.build_checks`: the accelerator, the layout, the example micro-batch).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_zeropp.accelerate.build_checks import (
    check_accelerator,
    default_example,
    example_rows,
    resolve_layout,
)
from lightning_zeropp.accelerate.data import (
    Unpack,
    check_loader,
    shard_loader,
    unpack_batch,
    widen_loader,
)
from lightning_zeropp.accelerate.engine import ZeroPPAccelerateEngine
from lightning_zeropp.accelerate.optim import PipelineScheduler
from lightning_zeropp.core.engine import LossFn, ZeroPPEngine
from lightning_zeropp.core.measure.layout import describe_layout
from lightning_zeropp.core.settings.config import ZeroPPConfig, ZeroPPLayout
from lightning_zeropp.core.split.methods import SplitMethod
from lightning_zeropp.core.step.failure import guarded
from lightning_zeropp.core.weights.materialize import InitFn
from lightning_zeropp.fronts.hf_loss import disable_kv_cache
from lightning_zeropp.fronts.optim import (
    OptimizerFactory,
    SchedulerFactory,
    optimizer_param_names,
    rebuild_optimizer,
    retarget_scheduler,
)
from lightning_zeropp.fronts.settings import RunSettings, merge_settings

__all__ = ["prepare_pipeline"]

log = logging.getLogger(__name__)


@guarded  # setup communicates: a rank failing or lost in it is named on every rank
def prepare_pipeline(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: Optimizer | OptimizerFactory,
    train_dl: DataLoader | None,
    scheduler: Any | SchedulerFactory | None = None,
    *,
    loss_fn: LossFn,
    probe_loss_fn: LossFn | None = None,
    config: ZeroPPConfig | ZeroPPLayout | RunSettings | None = None,
    split: SplitMethod | None = None,
    example_args: tuple[Any, ...] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    unpack: Unpack | None = None,
    per_process_batches: bool = False,
    load_from: str | Path | None = None,
    init: InitFn | None = None,
) -> tuple[ZeroPPAccelerateEngine, Optimizer, DataLoader | None, PipelineScheduler | None]:
    """Split, shard and schedule `model`; move the optimizer, scheduler and data onto it.

    Args:
        accelerator: an `Accelerator` whose process group spans the world (torchrun or
            `accelerate launch`; on CPU with `cpu=True` or `ACCELERATE_USE_CPU=1`).
        model: the whole model, unmodified. Drop your own reference afterwards (`del model`):
            the stages train new, sharded parameters, and the model would keep its full,
            no longer updated weights in memory.
        optimizer: built on `model`'s parameters (rebuilt over this rank's stages, same class,
            hyperparameters and param groups), or a factory `fn(engine_module) -> Optimizer`.
        train_dl: the single-process training loader (re-sharded over data-parallel ranks only)
            or None.
        scheduler: built on `optimizer` (retargeted to the rebuilt optimizer), a factory
            `fn(optimizer) -> scheduler`, or None.
        loss_fn: `loss_fn(output, target) -> scalar`, the mean over one micro-batch.
        probe_loss_fn: for torch's shape-inference call of the loss, which is no micro-batch of
            the step (default: `loss_fn`); give one without side effects.
        config: the layout; None reads the `ZEROPP_*` environment variables, then defaults.
        split: "auto" / "call" / "trace" / "stack" / a callable (see `lightning_zeropp.core.split`);
            None reads `ZEROPP_SPLIT`, then "auto".
        example_args / example_kwargs: one micro-batch of model inputs for the split's check;
            default: the first samples of `train_dl`'s dataset, collated, cut to one micro-batch.
        unpack: `fn(batch) -> (model_args, model_kwargs, target)`; default: `(inputs, targets)`
            or `{"input_ids", "labels", **model_kwargs}`.
        per_process_batches: the loader's batch size is per process, as under DDP (what
            `ZeroPPAccelerator` uses): each data-parallel rank reads `pp_size` (x `cp_size`)
            batches' rows at
            once, so a step trains on `batch_size x num_processes` rows, the loader has DDP's
            length and the scheduler steps `num_processes` times per update (Accelerate's
            convention). Default: the batch size is per data-parallel rank, and the scheduler
            steps `dp_size` times.
        load_from / init: where a meta-device model's shards get their values (see
            `ZeroPPEngine`); `load_from` also loads over a whole model's.

    Returns:
        `(engine, optimizer, train_dl, scheduler)`: the optimizer is an `AcceleratedOptimizer`
        (skips steps while accumulating), the scheduler a `PipelineScheduler`, registered for
        `accelerator.save_state`.
    """
    # 1. Everything a user can get wrong, on every rank, before any collective.
    check_accelerator(accelerator)
    settings = _settings(config, split)
    config = resolve_layout(settings, accelerator.num_processes)
    split = settings.split
    is_factory = callable(optimizer) and not isinstance(optimizer, Optimizer)
    given = cast(Optimizer, optimizer)  # when not a factory: an optimizer (checked there)
    group_names = None if is_factory else optimizer_param_names(given, model)
    unpack = unpack or unpack_batch
    dp_size = config.dp_size
    if train_dl is not None:
        if per_process_batches and not accelerator.split_batches:
            # a data-parallel rank's processes: its pipeline's, each CP rank reading all rows
            train_dl = widen_loader(train_dl, config.pp_size * config.cp_size)
        fills = accelerator.even_batches and split != "trace"
        check_loader(train_dl, accelerator.split_batches, dp_size, config.num_microbatches, fills)
    if example_args is None and example_kwargs is None and config.num_stages > 1:
        # split="stack" needs none, but checks its contract with one when the loader gives it.
        optional = split == "stack"
        if not optional or (train_dl is not None and example_rows(accelerator, train_dl, config)):
            example_args, example_kwargs = default_example(accelerator, train_dl, config, unpack)

    disable_kv_cache(model)  # HF models: a pipeline stage returns tensors only
    # 2. The mesh and this rank's stages (collectives from here on).
    _ensure_process_group(accelerator)
    core = ZeroPPEngine(
        model,
        config,
        loss_fn=loss_fn,
        probe_loss_fn=probe_loss_fn,
        split=split,
        example_args=example_args,
        example_kwargs=example_kwargs,
        device=_device(accelerator),
        load_from=load_from,
        init=init,
    )
    params = dict(core.module.named_parameters(remove_duplicate=False))  # every tied name
    if group_names is not None:
        _check_all_placed(group_names, params)
        new_opt = rebuild_optimizer(given, group_names, params)
    else:
        new_opt = cast(Callable[[nn.Module], Optimizer], optimizer)(core.module)
    # Both fronts print the layout once at setup (e.g. that ZeroPPPlugin defaulted to 1F1B).
    accelerator.print(describe_layout(core))  # collective: every pipeline rank counts its stages
    accelerator.print(core.memory_report(title="at setup"))  # collective: every rank measures
    core.report_memory_after_first_update([new_opt], accelerator.print)
    engine = ZeroPPAccelerateEngine(accelerator, core, new_opt, unpack)
    engine.batch_factor = config.pp_size * config.cp_size if per_process_batches else 1

    # 3. Accelerate's side. The optimizer is wrapped as `prepare` would wrap it, but not
    # registered: save_state would write rank 0's shard of it and load_state would load that shard
    # into every rank. The sharded optimizer state goes through the checkpoint hooks instead.
    wrapped = AcceleratedOptimizer(new_opt, device_placement=False, scaler=None)
    sched = None
    if scheduler is not None:
        # Accelerate's convention (AcceleratedScheduler): a scheduler written for one process
        # steps once per loaded batch, num_processes times per optimizer step under DDP.
        loads = accelerator.num_processes if per_process_batches else dp_size
        steps = 1 if accelerator.split_batches else loads
        target = optimizer if isinstance(optimizer, Optimizer) else None
        inner = retarget_scheduler(scheduler, target, new_opt)
        sched = PipelineScheduler(inner, accelerator, wrapped, steps)
        accelerator.register_for_checkpointing(sched)
    loader = shard_loader(accelerator, train_dl, core.dims) if train_dl is not None else None
    engine._register_hooks()
    return engine, wrapped, loader, sched


def _settings(
    config: ZeroPPConfig | ZeroPPLayout | RunSettings | None, split: SplitMethod | None
) -> RunSettings:
    """The settings to run with: a plugin's merged settings as they are, else `config` (every
    field counts as given) or the `ZEROPP_*` variables; `split=` given here wins."""
    if isinstance(config, RunSettings):
        return config if split is None else dataclasses.replace(config, split=split)
    settings = merge_settings(config, split=split, owner="prepare_pipeline")
    if settings.ignored and int(os.environ.get("RANK", "0")) == 0:
        log.warning("prepare_pipeline got config=...; ignoring %s", ", ".join(settings.ignored))
    return settings


def _check_all_placed(group_names: list[list[str]], params: dict[str, nn.Parameter]) -> None:
    """Every optimized parameter must be on some stage; checked with every rank's names."""
    everywhere: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everywhere, sorted(params))
    placed = set().union(*everywhere)
    lost = sorted({n for names in group_names for n in names} - placed)
    if lost:
        raise ValueError(
            f"the optimizer's parameters {lost[:5]} are on no pipeline stage: the split dropped "
            "them (parameters the forward never uses). Leave them out of the optimizer, or use "
            "split='stack'."
        )


def _ensure_process_group(accelerator: Accelerator) -> None:
    """A one-rank group when Accelerate runs a single process (debugging without a launcher)."""
    if dist.is_initialized():
        return
    backend = "nccl" if accelerator.device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(minutes=10),
    )


def _device(accelerator: Accelerator) -> torch.device:
    device = accelerator.device
    # Accelerate says "cpu:0" on multi-CPU runs; the mesh and stages want the plain CPU device.
    return torch.device("cpu") if device.type == "cpu" else device
