"""Setting up a LightningModule's pipeline: its network (`lightning.network`) split, sharded and
scheduled by the core engine, this rank's stages put in its place, and the layout printed.

The split needs one micro-batch of the network's inputs: the running stage's step is run on the
first micro-batch of the first batch up to its network call (or the module's forward on its
`example_input_array`), leaving no trace: no log, metric update, attribute change or random draw.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from lightning_zeropp.core.engine import ZeroPPEngine
from lightning_zeropp.core.measure.layout import describe_layout
from lightning_zeropp.core.mesh import ParallelDims, world_timeout
from lightning_zeropp.core.settings.config import ZeroPPLayout
from lightning_zeropp.core.split.copies import meta_copy
from lightning_zeropp.core.split.methods import SplitMethod
from lightning_zeropp.core.weights.materialize import InitFn
from lightning_zeropp.fronts.call_adapter import CallAdapter, get_call_adapter
from lightning_zeropp.fronts.hf_loss import disable_kv_cache, token_rule
from lightning_zeropp.fronts.loss_rule import LossWatch
from lightning_zeropp.fronts.microbatches import loss_shares
from lightning_zeropp.lightning.network import Network, summarize_whole_model
from lightning_zeropp.lightning.redirect import attributes_kept, first_batch, rng_kept
from lightning_zeropp.lightning.steps import StepRunner
from lightning_zeropp.lightning.weighting import GlobalTokenCount

__all__ = ["build_engine", "data_parallel_group"]


def build_engine(
    runner: StepRunner,
    module: pl.LightningModule,
    trainer: pl.Trainer,
    config: ZeroPPLayout,
    dims: ParallelDims,
    *,
    split: SplitMethod,
    module_name: str | None,
    device: torch.device,
    count_comms: bool,
    init: InitFn | None,
    load_from: str | Path | None,
    to_device: Callable[[Any], Any],
) -> ZeroPPEngine:
    """Split, shard and schedule the module's network; put this rank's stages in its place."""
    network = Network.of(module, module_name)
    runner.module, runner.network = module, network
    net = network.net
    # How the user's calls of the network map to stage inputs and outputs (e.g. HF's `labels=`
    # and `.logits`); read now, since the stages that replace the network do not carry it.
    runner.adapter = get_call_adapter(net)
    rule = token_rule(net) if type(runner.adapter) is CallAdapter else None
    if rule is not None and rule.causal and config.loss_chunk:
        # A training_step may read the logits (accuracy, its own loss): the Lightning front
        # never hands an HF head's hidden states to the loss, so an asked chunk would be ignored.
        # Raised on every rank alike, before the engine's first collective.
        raise ValueError(
            f"loss_chunk={config.loss_chunk} asks for the head and the loss in chunks, but the "
            f"Lightning front keeps {type(net).__name__}'s logits whole (a training_step may "
            "read them): leave loss_chunk unset (None) or set it to 0; ZeroPPAccelerator and "
            "ZeroPPTrainer compute an HF causal LM's own loss in chunks."
        )
    if rule is not None:
        # A plain HF model: padded batches' losses are token means over the global batch, as in
        # one process; tokens counted by the model's own loss rule, its loss calls watched.
        watch = LossWatch(net, rule)
        count = _summed(dims, device)
        context = config.cp_size > 1
        # each micro-batch's loss is averaged over the data-parallel ranks (under CP it is
        # computed on whole sequences, alike on every CP rank)
        ranks = loss_shares(1, dims, cp_parts=False)
        runner.adapter = GlobalTokenCount(rule, watch, count, ranks, net, context)
    disable_kv_cache(net)  # plain HF models: a stage returns tensors only
    example_args, example_kwargs = _example(runner, module, trainer, config, split, to_device)
    whole = meta_copy(net)  # before sharding: a single stage is sharded in place
    engine = ZeroPPEngine(
        net,
        config,
        loss_fn=runner.scheduled_loss,
        probe_loss_fn=runner.probe_loss,
        split=split,
        example_args=example_args,
        example_kwargs=example_kwargs,
        device=device,
        dims=dims,
        count_comms=count_comms,
        init=init,
        load_from=load_from,
    )
    network.install(engine.module, whole, ", ".join(map(str, engine.stage_ids)))
    runner.engine = engine
    runner.recorder.dp_group = data_parallel_group(dims)
    rank_zero_info(describe_layout(engine))  # collective: every rank builds the text
    rank_zero_info(engine.memory_report(title="at setup"))  # collective too
    summarize_whole_model(trainer, network, whole)
    # The example served the split. Lightning's model summary would feed it to this rank's
    # stages as if they were the whole model, so it goes.
    module.example_input_array = None
    return engine


def _example(
    runner: StepRunner,
    module: pl.LightningModule,
    trainer: pl.Trainer,
    config: ZeroPPLayout,
    split: SplitMethod,
    to_device: Callable[[Any], Any],
) -> tuple[tuple[Any, ...] | None, dict[str, Any] | None]:
    """One micro-batch of the network's inputs, for the splits that need one ("stack" checks its
    contract with it at setup)."""
    if callable(split) or config.num_stages == 1:
        return None, None
    assert trainer.state.fn is not None  # set by the trainer's entry point (fit, validate, ...)
    step = {
        TrainerFn.FITTING: module.training_step,
        TrainerFn.VALIDATING: module.validation_step,
        TrainerFn.TESTING: module.test_step,
        TrainerFn.PREDICTING: module.predict_step,
    }[trainer.state.fn]
    forward_args = module.example_input_array
    batch = None if forward_args is not None else to_device(first_batch(trainer))
    with rng_kept(), attributes_kept(module), runner.recorder.muted(module):
        return runner.example(batch, step, forward_args, config.num_microbatches)


def _summed(dims: ParallelDims, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    def count(local: torch.Tensor) -> torch.Tensor:
        total = local.to(device=device, dtype=torch.float64)
        for group in dims.dp_groups:
            dist.all_reduce(total, group=group)
        return total

    return count


def data_parallel_group(dims: ParallelDims) -> dist.ProcessGroup | None:
    """The group of every data-parallel rank at this rank's pipeline (and CP) position (None
    for one):
    where logged values are reduced (`sync_dist=True`). Collective: every rank calls it."""
    groups = dims.dp_groups
    if len(groups) <= 1:
        return groups[0] if groups else None
    pp_size, cp_size = dims.config.pp_size, dims.config.cp_size
    # (pp, cp, dp coordinate) -> global rank: the CP ranks of a replica hold the same values
    # (the step sees whole sequences), so a logged sum is over data-parallel ranks only
    grid = dims.mesh.mesh if cp_size > 1 else dims.mesh.mesh.unsqueeze(-1)
    ranks = grid.movedim(-1, 1).reshape(pp_size * cp_size, -1).tolist()
    mine, _ = dist.new_subgroups_by_enumeration(ranks, timeout=world_timeout())
    return mine
