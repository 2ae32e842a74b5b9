"""`ZeroPPAccelerator`: an `Accelerator` whose `prepare` pipelines the model over FSDP2.

The standard loop keeps its lines; only the import, the plugin and the construction change:

    accelerator = ZeroPPAccelerator(zeropp_plugin=ZeroPPPlugin(pp_size=2), cpu=True)
    model, optimizer, train_dl, eval_dl, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, lr_scheduler
    )
    for batch in train_dl:
        with accelerator.accumulate(model):
            outputs = model(**batch)          # the whole pipeline step, forward and backward
            accelerator.backward(outputs.loss)  # adds the step's gradients (see PipelineModel)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the global norm
            optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()

What differs from the base class, and why:
- `prepare` builds the pipeline (`prepare_pipeline`) and shards every loader over the
  data-parallel ranks only (all stages of a pipeline read the same batch).
- `clip_grad_norm_` clips by the norm over every stage and shard: torch's clipping sees this
  rank's stages only.
- `gather` / `gather_for_metrics` concatenate each process's share of its pipeline's batch, in
  DDP's order (`shares`, `gathering`): every sample once, where DDP would put it; in eval mode
  `outputs.loss` is the loss of the process's share, as under DDP.
- `save_state(dir)` commits atomically (a temporary sibling renamed when complete); the sharded
  model and optimizer go through `prepare_pipeline`'s checkpoint hooks (`checkpointing`).
- `get_state_dict` / `save_model` / `unwrap_model` give the whole model (collective calls, like
  Accelerate's FSDP full state dict: every rank calls them; the weights land on the main process).
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.state import PartialState
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_zeropp.accelerate import checkpointing
from lightning_zeropp.accelerate.build import prepare_pipeline
from lightning_zeropp.accelerate.checkpointing import BATCHES, EPOCH, ROWS, commit_state
from lightning_zeropp.accelerate.gathering import GatheringAccelerator
from lightning_zeropp.accelerate.preempt import Stopper, accelerate_saver, agree_at_end
from lightning_zeropp.accelerate.prepared import check_state_made_before, is_scheduler, tied_names
from lightning_zeropp.accelerate.prepared import skeleton as _skeleton
from lightning_zeropp.accelerate.prepared import unpack_call as _unpack_call
from lightning_zeropp.accelerate.settings import ZeroPPPlugin
from lightning_zeropp.accelerate.shares import process_order, share_of
from lightning_zeropp.accelerate.steps import PipelineModel
from lightning_zeropp.core.settings import launch
from lightning_zeropp.core.step.failure import guarded
from lightning_zeropp.core.step.preempt import Preemption
from lightning_zeropp.core.weights.export import full_state_dict
from lightning_zeropp.core.weights.trust import weights_only_loads
from lightning_zeropp.fronts.hf_chunked import ChunkedHead
from lightning_zeropp.fronts.hf_loss import disable_kv_cache, token_rule
from lightning_zeropp.fronts.loss_rule import LossWatch

__all__ = ["ZeroPPAccelerator"]


class ZeroPPAccelerator(GatheringAccelerator):
    """`Accelerator(**kwargs)` with ZeroPP pipelines; `zeropp_plugin` holds the layout (default:
    the `ZEROPP_*` variables `accelerate launch` carries, then the library's defaults)."""

    def __init__(self, *args: Any, zeropp_plugin: ZeroPPPlugin | None = None, **kwargs: Any):
        launch.check_restart()  # before Accelerate forms the process group
        # SIGTERM is recorded from here on, never acted on in the handler (`accelerate.preempt`).
        Preemption.of_process().install()
        made_before = bool(PartialState._shared_state)  # read without creating it
        super().__init__(*args, **kwargs)
        check_state_made_before(made_before, self.num_processes)
        self.zeropp_plugin = zeropp_plugin or ZeroPPPlugin()
        self.pipeline: PipelineModel | None = None
        self._skeleton: nn.Module | None = None
        self._order: list[int] = []  # global ranks in DDP's process order (`shares`)
        self._rows: int | None = None  # of one training loader batch over all processes

    # ------------------------------------------------------------------------- prepare
    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        models = [a for a in args if isinstance(a, nn.Module) and not isinstance(a, PipelineModel)]
        optimizers = [a for a in args if isinstance(a, Optimizer)]
        loaders = [a for a in args if isinstance(a, DataLoader)]
        schedulers = [a for a in args if is_scheduler(a)]
        if len(models) > 1 or len(optimizers) > 1 or len(schedulers) > 1:
            raise ValueError(
                "ZeroPPAccelerator.prepare takes one model, one optimizer and one scheduler "
                f"(got {len(models)}, {len(optimizers)}, {len(schedulers)}): one pipeline per run."
            )
        prepared: dict[int, Any] = {}
        if models:
            if self.pipeline is not None:
                raise ValueError("ZeroPPAccelerator already prepared a model; prepare one per run.")
            if not optimizers:
                raise ValueError(
                    "prepare the model together with its optimizer (accelerator.prepare(model, "
                    "optimizer, train_dataloader, ...)): the optimizer is rebuilt over the "
                    "pipeline stages."
                )
            prepared.update(self._build(models[0], optimizers[0], loaders, schedulers))
        elif self.pipeline is None and loaders:
            raise ValueError(
                "prepare the model (with its optimizer and training loader) before other data "
                "loaders: loaders are sharded over the pipeline's data-parallel ranks."
            )
        for loader in loaders:
            if id(loader) not in prepared:
                assert self.pipeline is not None
                # Loaders after the first evaluate (run_clm's eval loader): any rows will do.
                engine = self.pipeline.engine
                prepared[id(loader)] = self._track(engine.prepare_data_loader(loader, check=False))
        out = tuple(prepared.get(id(a), a) for a in args)
        return out[0] if len(out) == 1 else out

    def _build(
        self, model: nn.Module, optimizer: Optimizer, loaders: list[DataLoader], schedulers: list
    ) -> dict[int, Any]:
        disable_kv_cache(model)
        plugin = self.zeropp_plugin
        # How the model's own loss counts tokens, observed; its stages' loss calls are watched.
        rule = token_rule(model)
        if plugin.seq_buckets is not None and (rule is None or not rule.causal):
            raise ValueError(
                f"ZeroPPPlugin(seq_buckets={plugin.seq_buckets!r}) pads sequences, which leaves "
                f"the numbers unchanged only for causal LMs; {type(model).__name__} is not one. "
                "Drop seq_buckets."
            )
        holder: list[PipelineModel] = []
        skeleton = _skeleton(model)  # the whole model's structure, for unwrap_model
        # An HF causal LM's head and loss in chunks in training (`fronts.hf_chunked`), before
        # the watch wraps its loss function: the watch sees the call as the model made it.
        chunked = rule is not None and rule.causal and ChunkedHead.install(model)
        watch = LossWatch(model, rule) if rule is not None else None
        engine, opt, loader, sched = prepare_pipeline(
            self,
            model,
            optimizer,
            loaders[0] if loaders else None,
            schedulers[0] if schedulers else None,
            loss_fn=lambda output, target: holder[0].loss_fn(output, target),
            probe_loss_fn=lambda output, target: holder[0].probe_loss_fn(output, target),
            config=plugin.run_settings(),
            unpack=_unpack_call(rule is not None),
            per_process_batches=True,
            load_from=plugin.load_from,
            init=plugin.init,
        )
        pipeline = PipelineModel(engine, skeleton, rule, watch)
        pipeline.eval_logits = plugin.eval_logits
        pipeline.chunked = chunked
        pipeline.seq_buckets = plugin.seq_buckets
        save = bool(engine.core.config.save_on_sigterm)
        steps = lambda: self.gradient_accumulation_steps  # noqa: E731 - read at the stop
        pipeline.stopper = stopper = Stopper(accelerate_saver(self), save, steps)
        # Kept with save_state: the global batch (a resume's skip is checked against it) and
        # the training batches run (the SIGTERM message's step numbers go on after a resume).
        rows = (
            checkpointing.global_rows(loaders[0], self.split_batches, self.num_processes)
            if loaders
            else None
        )
        epoch = checkpointing.epoch_batches(loader) if loaders else None
        engine.record = lambda: {ROWS: rows, BATCHES: stopper.batches, EPOCH: epoch}
        self._rows = rows
        holder.append(pipeline)
        self.pipeline, self._skeleton = pipeline, skeleton
        self._order = process_order(share_of(engine.dims)[1], engine.dims.dp_rank)
        prepared: dict[int, Any] = {id(model): pipeline, id(optimizer): opt}
        if loaders:
            prepared[id(loaders[0])] = self._track(loader)
        if schedulers:
            prepared[id(schedulers[0])] = sched
        return prepared

    def _track(self, loader: DataLoader) -> DataLoader:
        self._dataloaders.append(loader)  # as Accelerator.prepare_data_loader records them
        return loader

    # ------------------------------------------------------------------------- gradients
    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        if self.pipeline is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        params: list[Any] = (
            [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        )
        mine = {id(p) for p in self.pipeline.parameters()}
        if any(id(p) not in mine for p in params):
            raise ValueError(
                "clip_grad_norm_ got tensors that are not the pipelined model's parameters; pass "
                "model.parameters() of the model accelerator.prepare returned."
            )
        # The engine's clipping: the global norm, a tied weight's per-stage copies counted once.
        return self.pipeline.engine.core.clip_grad_norm_(max_norm, norm_type, params)

    # ------------------------------------------------------------------------- state
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kw: Any):
        """`Accelerator.save_state`, committed atomically (`accelerate.checkpointing`)."""
        if self.pipeline is None:
            return super().save_state(output_dir, safe_serialization, **kw)
        base = super().save_state
        return commit_state(self, output_dir, lambda tmp: base(tmp, safe_serialization, **kw))

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kw: Any):
        """`Accelerator.load_state`, every file read as data: the pre-hook checks them
        (`accelerate.checkpointing.check_state_files`), and Accelerate's own reads, which take
        registered objects with `weights_only=False`, run with `weights_only` forced."""
        with weights_only_loads():
            done = super().load_state(input_dir, load_kwargs, **kw)
        if self.pipeline is not None and self.pipeline.stopper is not None:
            loaded = self.pipeline.engine.loaded
            checkpointing.check_loaded_rows(input_dir, loaded, self._rows)
            self.pipeline.stopper.batches = int(loaded.get(BATCHES, 0))
        return done

    def end_training(self) -> None:
        """Accelerate's, after every rank agrees whether SIGTERM came after the last step (it
        stops there, 143, saving with `save_on_sigterm`); the SIGTERM handler this accelerator
        installed is replaced by the one before it."""
        try:
            agree_at_end(self.pipeline)
        finally:
            Preemption.of_process().uninstall()
        super().end_training()

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """Accelerate's; after `load_state`, refused on every rank if the state was saved with
        another global batch (`checkpointing.check_skipped_rows`): the skipped batches would
        not be the trained rows."""
        if self.pipeline is not None:
            loaded = self.pipeline.engine.loaded
            checkpointing.check_skipped_rows(num_batches, loaded, self._rows)
        return super().skip_first_batches(dataloader, num_batches)

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Collective: the whole model's state dict on the main process ({} elsewhere)."""
        if not isinstance(model, PipelineModel):
            return super().get_state_dict(model, unwrap)
        engine = model.engine
        with engine.core.failures.guard():
            return full_state_dict(engine.module, engine.dims)

    def unwrap_model(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        """Collective for the pipelined model: the whole model, with the trained weights on the
        main process; on other ranks its weights stay on the meta device (any use fails
        loudly rather than computing with stale weights)."""
        if not isinstance(model, PipelineModel):
            return super().unwrap_model(model, *args, **kwargs)
        state = self.get_state_dict(model)
        whole = model.original
        if state:
            ties = tied_names(whole)  # before `assign` gives every name its own parameter
            whole.load_state_dict(state, strict=False, assign=True)
            for first, *others in ties:  # tied again, as the model was: one parameter
                shared = whole.get_parameter(first)
                for name in others:
                    owner, _, attr = name.rpartition(".")
                    setattr(whole.get_submodule(owner), attr, shared)
        return whole


# Every call that communicates runs under the failure board: a rank failing or lost in it is
# named on every rank (`core.step.failure`), as inside a training step.
for _name in (
    "prepare",
    "gather",
    "gather_for_metrics",
    "reduce",
    "pad_across_processes",
    "wait_for_everyone",
    "save_state",
    "load_state",
    "get_state_dict",
    "save_model",
    "unwrap_model",
):
    setattr(ZeroPPAccelerator, _name, guarded(getattr(ZeroPPAccelerator, _name)))
