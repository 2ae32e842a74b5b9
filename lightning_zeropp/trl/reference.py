"""DPO's reference model run each step, through the policy's own pipeline (`ZeroPPDPOTrainer`).

Under `precompute_ref_log_probs=False` (`DPOConfig`'s default) TRL 1.16 calls a frozen reference
model on every batch: the `ref_model` passed in, else one it loads from the policy's path (its
initial weights). Here the reference runs forward-only through the policy's stages and schedule
(the pipeline's evaluation forward, which torch's pipelining runs as it runs any evaluation),
with the reference's weights swapped into this rank's shards for that call and the policy's
swapped back after it. Why not a second pipeline: torch's pipelining binds a schedule to its
stages' modules, so a second pipeline would mean a second split, sharding, schedule and set of
process groups (and a second engine's checkpoints and failure handling) for a model that never
trains; swapping shards in place is how the weights are loaded into the stages anyway (FSDP2
gathers each call's weights from the shards), costs one frozen copy of this rank's shards, and
the reference sees exactly the policy's split, precision and micro-batches.

`FrozenReference` holds the reference's weights as this rank's shards of the policy's
parameters (cut from the reference's full state dict as the policy's DTensors are placed, with
no communication); `reference_logps` runs the evaluation forward with a last-stage function that
sums each completion's log-probabilities, and sends them from the last stage to the pipeline's
other ranks (every rank then calls the training step with the same batch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_zeropp.core.step.grads import StepGrads

__all__ = ["FrozenReference", "completion_logps", "reference_logps"]


def completion_logps(
    output: Any, labels: torch.Tensor, completion_mask: torch.Tensor
) -> torch.Tensor:
    """Each row's summed log-probability of its completion tokens (TRL's `logps`): position t's
    logits predict label t+1, counted where the completion mask is set."""
    logits = output["logits"][:, :-1].float()
    target = labels[:, 1:]
    mask = completion_mask[:, 1:].bool()
    logp = logits.log_softmax(-1)
    picked = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0] * mask
    return picked.sum(dim=1)


class FrozenReference:
    """The reference model's weights as this rank's shards of the pipeline's parameters."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], state: dict[str, torch.Tensor]):
        # Each rank checks its own stages' parameters; the verdict is agreed over the world
        # before anything else runs, so a bad ref_model is refused on every rank (a rank whose
        # stages happen to fit would otherwise go on into the first step's collectives and wait).
        problem = next((p for name, param in params if (p := _mismatch(name, param, state))), None)
        _refuse_on_every_rank(problem)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, param in params:
            full = state[name]
            local, shard = param.detach(), full.detach()
            if isinstance(param, DTensor):
                # cut as the policy's parameter is placed; every rank holds the full tensor, so
                # no rank sends (src_data_rank=None)
                placed = distribute_tensor(
                    shard.to(param.device), param.device_mesh, param.placements, src_data_rank=None
                )
                local, shard = param.to_local().detach(), placed.to_local()
            self._pairs.append((local, shard.to(local.device).clone()))

    @contextlib.contextmanager
    def weights(self) -> Iterator[None]:
        """The reference's weights in the pipeline's shards for the block, the policy's after."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for local, frozen in self._pairs:
            held = local.clone()  # one parameter's shard at a time
            local.copy_(frozen)
            frozen.copy_(held)


def _mismatch(name: str, param: nn.Parameter, state: dict[str, torch.Tensor]) -> str | None:
    full = state.get(name)
    if full is None or tuple(full.shape) != tuple(param.shape):
        got = "missing" if full is None else f"of shape {tuple(full.shape)}"
        return (
            f"ZeroPPDPOTrainer: the reference model's {name!r} is {got}; the policy's is "
            f"{tuple(param.shape)}. Pass a ref_model of the policy's architecture "
            "(or ref_model=None: the policy's initial weights)."
        )
    if full.dtype != param.dtype:
        return (
            f"ZeroPPDPOTrainer: the reference model's {name!r} is {full.dtype}, the "
            f"policy's {param.dtype}: load the ref_model in the policy's dtype."
        )
    return None


def _refuse_on_every_rank(problem: str | None) -> None:
    """Raise `problem` (this rank's, or the first rank's that has one) on every rank."""
    problems = [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    found = next(((r, p) for r, p in enumerate(problems) if p), None)
    if found is not None:
        rank, message = found
        raise ValueError(message if problem == message else f"rank {rank}: {message}")


def reference_logps(pipeline: Any, inputs: dict[str, Any], frozen: FrozenReference) -> torch.Tensor:
    """Collective over the pipeline's ranks: each row's reference completion log-probability,
    from an evaluation forward of `inputs` (keyword batch with `labels`, `completion_mask`)
    under the reference's weights, on every rank of the pipeline."""
    engine = pipeline.engine
    core, dims = engine.core, engine.dims
    found: list[torch.Tensor] = []

    def logps(output: Any, labels: torch.Tensor, num_items_in_batch: float, **rows: Any) -> Any:
        found.append(completion_logps(output, labels, rows["completion_mask"]).detach())
        return output["logits"].new_zeros(())

    kept_loss, kept_logits, training = pipeline.last_loss, pipeline.eval_logits, pipeline.training
    # pairs (chosen, rejected rows) are a unit: whole pairs per micro-batch, as the policy's
    # call, and no labels masked (`accelerate.repeats` masks single rows only): every row's
    # value is read, a repeated pair's too, which the loss weighs (`counted`)
    pipeline.use_loss(logps, shift=1, rows=("completion_mask",), group=2)
    pipeline.eval_logits = False  # nothing reads them: no broadcast
    pipeline.eval()
    # an accumulation window's gradients so far, out of the way: the pipeline's runtime divides
    # every gradient present by the micro-batch count, in a forward-only step too
    held = StepGrads(pipeline.engine.parameters())
    try:
        with frozen.weights(), torch.no_grad():
            pipeline(**inputs)
    finally:
        held.apply()
        pipeline.last_loss, pipeline.eval_logits = kept_loss, kept_logits
        pipeline.train(training)
    rows = inputs["input_ids"].shape[0]
    values = torch.zeros(rows, dtype=torch.float32, device=core.device)
    if found:  # the last stage: its micro-batches in order (torch's shape probe came first)
        tail: list[torch.Tensor] = []
        while sum(t.shape[0] for t in tail) < rows:
            tail.insert(0, found.pop())
        values = torch.cat(tail).to(core.device, torch.float32)
    if core.config.pp_size > 1:
        dist.broadcast(values, group=dims.pp_group, group_src=core.last_pp_rank)
    return values
