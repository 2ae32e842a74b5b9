"""The model `ZeroPPAccelerator.prepare` returns: `model(**batch)` runs a whole pipeline step.

A pipeline cannot run the forward now and the backward later, when the loop calls
`accelerator.backward(loss)`: the schedule interleaves both over the micro-batches. So in
training mode the call runs forward and backward of the whole batch (as Accelerate's Megatron-LM
integration does), and returns an output whose `.loss` is the global-batch loss `L`, a leaf
tensor that requires grad. What the loop does with it keeps its meaning: when its backward
reaches that leaf with the gradient `c = d(what the loop differentiates) / dL` (1 for
`backward(loss)`, `1/k` for Accelerate's accumulation scaling, anything for a transformed loss),
the step's gradients are added to `.grad` times `c`, as autograd would add them in one process.
A step that is never backpropagated adds nothing.

The loss is the mean over the global batch's real tokens, as one process computes it
(`accelerate.weighting`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_zeropp.accelerate.engine import ZeroPPAccelerateEngine
from lightning_zeropp.accelerate.last_loss import LastStageLoss, run_with_loss
from lightning_zeropp.accelerate.outputs import (
    TRAINING_ONLY_LOSS,
    PipelineOutput,
    any_tensor,
    broadcast_logits,
    call_rows,
    loss_of,
    target_of,
)
from lightning_zeropp.accelerate.preempt import Stopper
from lightning_zeropp.accelerate.shares import (
    eval_microbatches_by_share,
    share_losses,
    share_of,
)
from lightning_zeropp.accelerate.weighting import weigh_tokens
from lightning_zeropp.core.step.failure import guarded
from lightning_zeropp.core.step.last_loss import LastLossStep
from lightning_zeropp.core.step.preempt import PreemptedError
from lightning_zeropp.fronts.hf_chunked import armed, check_consumed
from lightning_zeropp.fronts.hf_loss import NUM_ITEMS, TokenRule, accepts_num_items
from lightning_zeropp.fronts.loss_rule import LossWatch
from lightning_zeropp.fronts.microbatches import call_microbatches
from lightning_zeropp.fronts.packing import Reshaped, SeqBuckets, reshape

__all__ = [
    "NUM_ITEMS",
    "PipelineModel",
    "PipelineOutput",
    "accepts_num_items",
    "loss_of",
]


class PipelineModel(nn.Module):
    """This rank's pipeline stages, called like the model they came from.

    `parameters()` are this rank's (sharded) parameters under the model's own names, so
    `accelerator.clip_grad_norm_(model.parameters(), ...)` and parameter-group code work;
    `train()` / `eval()` switch the stages. `engine` is the `ZeroPPAccelerateEngine`.
    """

    engine: ZeroPPAccelerateEngine  # these two set with object.__setattr__: not submodules
    original: nn.Module

    def __init__(
        self,
        engine: ZeroPPAccelerateEngine,
        original: nn.Module,
        rule: TokenRule | None = None,
        watch: LossWatch | None = None,
    ) -> None:
        super().__init__()
        self.module = engine.module
        object.__setattr__(self, "engine", engine)
        # The user's model, for unwrap_model (not a submodule: its weights are not ours).
        object.__setattr__(self, "original", original)
        # How the model's own loss counts tokens (`fronts.hf_loss.token_rule`; None: it cannot
        # be weighed by tokens), and the check that its forward computed it so.
        self.rule, self.watch = rule, watch
        self.token_weighted = rule is not None
        # A causal LM (its loss skips each row's first label): packed rows may be regrouped and
        # lengths padded to buckets without changing a number (`fronts.packing`).
        self.shifts = rule is not None and rule.causal
        self.eval_logits = True
        # The model's head and loss compute in chunks in training (`fronts.hf_chunked`): the
        # training output holds the loss only, so nothing reads the logits.
        self.chunked = False
        self.seq_buckets: SeqBuckets = None
        self._captured: list[Any] | None = None
        self._losses: list[torch.Tensor] | None = None  # an eval call's, per micro-batch
        self._items: float | None = None  # num_items_in_batch given to this call's forwards
        # What a micro-batch's own mean loss is rescaled to a sum over (`LossWatch.settle`).
        self._divisor: float | None = None
        self.rows: int | None = None  # of the last call's batch as run (regrouped: `shares`)
        self.given_rows: int | None = None  # of the last call's batch as given (`gather`)
        self.stopper: Stopper | None = None  # on SIGTERM: save and name the step (the front's)
        self.last_loss: LastStageLoss | None = None  # `use_loss`
        self._last_step: LastLossStep | None = None  # this call's, while it runs

    def use_loss(
        self,
        loss_fn: Any,
        *,
        shift: int | None = None,
        rows: tuple[str, ...] = (),
        ignore_index: int = -100,
        group: int = 1,
    ) -> None:
        """Compute the loss on the last stage with `loss_fn(output, labels, num_items_in_batch=n,
        **rows)` instead of the model's own (`core.step.last_loss`): it returns the micro-batch's
        summed loss over `n`, or `(loss, {name: scalar})`; the metrics reach every rank as the
        output's `.metrics`. `shift`: leading labels of each row never counted (default: 1 for a
        causal LM, else 0); `rows`: per-row tensors of the batch also handed to `loss_fn` (the
        model is called with the batch as it is); `group`: consecutive rows a micro-batch never
        splits (a pair: 2). `None` goes back to the model's own loss."""
        if loss_fn is None:
            self.last_loss = None
            return
        if not callable(loss_fn):
            raise TypeError(f"use_loss needs a callable, got {type(loss_fn).__name__}")
        asked = self.engine.config.loss_chunk
        if asked:  # a number the user set: chunking would silently not happen
            raise ValueError(
                f"loss_chunk={asked} asks for the head and the loss in chunks, but a loss "
                "computed on the last stage from the model's output (use_loss: a loop's own "
                "loss, the Trainer's compute_loss_func or label smoothing, TRL's trainers) reads "
                "whole logits: leave loss_chunk unset (None: chunks where the run can) or set it "
                "to 0."
            )
        if shift is None:
            shift = 1 if self.shifts else 0
        self.last_loss = LastStageLoss(loss_fn, int(shift), tuple(rows), ignore_index, int(group))

    # ---------------------------------------------------------------- calls
    @guarded  # token counts and logits are collectives too: a lost rank is named
    def forward(self, *args: Any, **kwargs: Any) -> PipelineOutput:
        # The first stage's batch on every stage (a random collator draws on each rank),
        # written into the caller's tensors: what the loop reads of it later agrees.
        batches = self.engine.core.batches
        args, kwargs = batches.share((args, kwargs))
        batches.check((args, kwargs) if args else kwargs, "the batch given to the model")
        self.given_rows = call_rows(args, kwargs)
        try:
            return self._forward(args, kwargs)
        except PreemptedError as err:  # SIGTERM, agreed on by every rank before this step
            if self.stopper is None:
                raise
            raise self.stopper.stopped(err, self.engine.core.failures.description) from None

    def _forward(self, args: Any, kwargs: dict[str, Any]) -> PipelineOutput:
        self._check_context()
        if self.last_loss is not None:
            if args:
                raise ValueError(
                    "a pipelined model with a last-stage loss (use_loss) takes keyword inputs "
                    "only (model(**batch))"
                )
            return run_with_loss(self, kwargs, PipelineOutput)
        shaped = self._reshaped(args, kwargs)
        kwargs = shaped.batch
        target = target_of(args, kwargs)
        if self.training and torch.is_grad_enabled():
            if target is None:
                raise ValueError(
                    "a training call of the pipelined model needs labels (labels=...): the "
                    "pipeline computes the loss inside the call and runs the backward with it."
                )
            return self._train(args, kwargs, target)
        out = self._eval(args, kwargs, target)
        if "logits" in out:
            out["logits"] = shaped.restore(out["logits"])
        return out

    def _reshaped(self, args: Any, kwargs: dict[str, Any]) -> Reshaped:
        """A causal LM's keyword batch with packed rows regrouped into as many rows as the
        micro-batches need and its length padded to a bucket (`fronts.packing`: exact)."""
        if args or not self.shifts:
            return Reshaped(kwargs)
        assert self.engine.core.config.num_microbatches is not None
        return reshape(kwargs, self.engine.core.config.num_microbatches, self.seq_buckets)

    def _train(self, args: Any, kwargs: dict[str, Any], target: torch.Tensor) -> PipelineOutput:
        core = self.engine.core
        self.rows = call_rows(args, kwargs)
        kwargs = self._weighted(kwargs, target, core.config.num_microbatches, training=True)
        with self._counting(), armed(self.chunked):
            loss, grads = core.train_step_deferred(
                *args, target=self._context_target(target), **kwargs
            )
        if self.stopper is not None:
            self.stopper.batches += 1
        leaf = loss.detach().clone().requires_grad_()
        # The loop's backward reaches the loss with d(what it differentiates)/dL: this step's
        # gradients go to .grad times that (on the device: no host sync).
        leaf.register_hook(lambda grad: grads.apply(grad))
        out = PipelineOutput(loss=leaf)
        out._hint = TRAINING_ONLY_LOSS
        return out

    @torch.no_grad()
    def _eval(self, args: Any, kwargs: dict[str, Any], target: torch.Tensor | None) -> Any:
        core = self.engine.core
        cfg = core.config
        self.rows = rows = call_rows(args, kwargs)
        self._items = None
        # Micro-batches inside one process's share each: the loss is the share's (`shares`).
        shares = share_of(core.dims)[0]
        by_share = eval_microbatches_by_share(rows, cfg.num_microbatches, shares)
        micro = by_share or call_microbatches(rows, cfg.num_microbatches, training=False)
        scale, chosen = None, False
        if target is None and self.token_weighted:
            # No loss to weigh, but every call must reach the blocks alike (HF hands its keyword
            # arguments down to them): the split checked a call carrying the count.
            kwargs = {NUM_ITEMS: 1.0, **kwargs}
        if target is not None:
            chosen = NUM_ITEMS in kwargs and self.token_weighted
            kwargs = self._weighted(kwargs, target, micro)
            scale = kwargs[NUM_ITEMS] if self.token_weighted and not chosen else None
        self._captured = [] if self.eval_logits else None
        self._losses = []
        try:
            with self._counting() if target is not None else contextlib.nullcontext():
                loss = core.eval_step(
                    *args,
                    target=self._context_target(target)
                    if target is not None
                    else any_tensor(args, kwargs),
                    microbatches=micro,
                    **kwargs,
                )
            logits = broadcast_logits(core, self._captured) if self.eval_logits else None
            if target is not None and by_share is not None:
                loss = self._share_loss(target, kwargs, scale)
            if target is not None and chosen:
                assert loss is not None  # a step with a target has a loss
                # Each micro-batch's loss is its token sum over the caller's count: the model
                # called on these rows returns their sum over it, not the micro-batches' mean.
                loss = loss * (micro // shares if by_share is not None else micro)
        finally:
            self._captured = self._losses = None
        out = PipelineOutput()
        if target is not None:
            out["loss"] = loss
        if logits is not None:
            out["logits"] = logits
        return out

    def _share_loss(
        self, target: torch.Tensor, kwargs: dict[str, Any], scale: float | None
    ) -> torch.Tensor:
        """This process's share of the batch's loss (`shares`): from the last stage's micro-batch
        losses, each share's, sent to the pipeline's other ranks."""
        core = self.engine.core
        shares, index = share_of(core.dims)
        values = torch.zeros(shares, device=core.device)
        if self._losses:  # the last stage
            tokens = None
            if scale is not None and self.rule is not None:
                pre = kwargs.get("shift_labels")
                tokens = self.rule.counts(
                    target, shares, pre if isinstance(pre, torch.Tensor) else None
                )
            losses = self._losses
            if core.dims.cp_group is not None:  # each CP rank's losses sum its part's tokens
                stacked = torch.stack(losses)
                dist.all_reduce(stacked, group=core.dims.cp_group)
                losses = list(stacked)
            values = share_losses(losses, shares, scale, tokens).to(core.device)
        if core.config.pp_size > 1:
            dist.broadcast(values, group=core.dims.pp_group, group_src=core.last_pp_rank)
        return values[index]

    # ---------------------------------------------------------------- the engine's loss
    def loss_fn(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """Per micro-batch, on the last stage: the model's own loss (already weighted by
        `num_items_in_batch` when the model takes it); keeps the logits in eval mode."""
        whole = self._last_step is not None and self._last_step.whole
        if whole:
            # a last-stage loss under CP runs on whole sequences, on every CP rank alike, as the
            # Lightning front's step does (`core.step.context_attention.whole_sequences`)
            output = self.engine.core.whole_sequences(output)
        if self._captured is not None:
            logits = (
                output.get("logits") if hasattr(output, "get") else getattr(output, "logits", None)
            )
            if logits is None and isinstance(output, torch.Tensor) and output.dim() > 0:
                logits = output
            # whole sequences under context parallelism, on every CP rank alike
            self._captured.append(logits if whole else self.engine.core.whole_sequences(logits))
        if self._last_step is not None:  # a last-stage loss (`use_loss`): never armed
            return self._last_step(output, target)
        if self.chunked:
            check_consumed()  # the head's hidden states went to the loss, not read as logits
        loss = loss_of(output)
        if self.watch is not None and self._items is not None and loss is not None:
            # the forward's loss as its token sum over the count, or refused (`fronts.loss_rule`)
            shifted = self.engine.config.cp_size > 1  # `_context_target`
            loss = self.watch.settle(loss, target, self._items, self._divisor, shifted)
        if self._losses is not None and loss is not None:
            self._losses.append(loss.detach())
        if loss is None:
            if not torch.is_grad_enabled() and self._captured is not None:
                return torch.zeros((), device=target.device)
            raise ValueError(
                f"the model returned {type(output).__name__} without a loss: under "
                "ZeroPPAccelerator the model call computes the loss (HF models do when given "
                "labels=...). For a loss computed outside the model, use prepare_pipeline(..., "
                "loss_fn=...)."
            )
        return loss

    def probe_loss_fn(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """torch's shape-inference call of the loss: a last-stage loss is run on it without
        counting it as a micro-batch; else as `loss_fn`."""
        if self._last_step is not None:
            return self._last_step.probe(output, target)
        return self.loss_fn(output, target)

    # ---------------------------------------------------------------- context parallelism
    def _check_context(self) -> None:
        """Under context parallelism each CP rank's forward sees its part of every sequence:
        the model's own loss must sum that part's tokens over a count the front gives
        (`num_items_in_batch`, HF causal LMs); a loss that cannot be weighed so is refused."""
        cp = self.engine.config.cp_size
        if cp == 1:
            return
        if self.last_loss is not None:
            # the loss runs on whole sequences (`loss_fn`): the model computes none of its own.
            # Rows are not split under CP, so a loss over pairs of rows (DPO's) runs as at cp 1
            # (a head pooling each row in its forward is refused at setup: `core.step.context`)
            return
        if self.rule is None or self.rule.pre_shift is None:
            raise ValueError(
                f"{type(self.original).__name__} cannot run under context parallelism "
                f"(cp_size={cp}) in this front: its loss must take num_items_in_batch and "
                "shift_labels (an HF causal LM's loss_function does), since each CP rank holds "
                "part of every sequence. Use an HF causal LM, prepare_pipeline(..., loss_fn=...), "
                "or set cp_size=1."
            )

    def _context_target(self, target: torch.Tensor | None) -> torch.Tensor | None:
        """The loss's target under context parallelism: the labels shifted on the whole
        sequence (each position's own target, what the core hands the model as
        `shift_labels`), so each CP rank's part is its positions' targets."""
        if target is None or self.engine.config.cp_size == 1 or target.dim() < 2:
            return target
        return torch.cat([target[:, 1:], torch.full_like(target[:, :1], -100)], 1)

    # ---------------------------------------------------------------- token weighting
    def _weighted(
        self, kwargs: dict[str, Any], target: torch.Tensor, micro: int, training: bool = False
    ) -> dict[str, Any]:
        """`kwargs` weighted by the global batch's tokens (`accelerate.weighting`); remembers
        the count the forward's own loss call must have used, and what a model ignoring it is
        rescaled by: in training the batch's own count, as one process's call of that model
        divides by its batch (the Trainer's count spans its accumulation window); in
        evaluation the count given (the batch's own, for the Trainer)."""
        kwargs, self._items, own = weigh_tokens(
            kwargs, target, micro, self.rule, self.engine.dims, self.engine.device, self.original
        )
        self._divisor = own if training and own is not None else self._items
        return kwargs

    def _counting(self) -> contextlib.AbstractContextManager[None]:
        """Around a step whose losses are settled: the model's own mean losses are counted."""
        if self.watch is None or self._items is None:
            return contextlib.nullcontext()
        return self.watch.counting()
