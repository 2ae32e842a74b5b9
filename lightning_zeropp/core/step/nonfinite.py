"""Non-finite losses: stop with the step and the stage that produced them, or skip the step.

A NaN in any stage's activations, weights or loss ends as a NaN loss, which the engine already
hands to every rank (the same value everywhere). So the check itself needs no communication:
every rank sees the same loss and decides alike. Only when it fires do the ranks compare notes
(one small all-reduce) to say where the first non-finite value appeared.

Where: a forward hook on each of this rank's stages folds "was any output non-finite" into a
device flag per stage, per step (no host sync on the hot path: the flag is read only after a bad
loss). The error then names the first stage whose output was non-finite, whether its weights
already were, or the loss function when every stage output was finite.

`ZeroPPConfig(nonfinite="raise")` (default) raises `FloatingPointError` on every rank;
`"skip"` drops the step's gradients on every rank (earlier accumulated ones stay), so an
optimizer step after it changes nothing this batch caused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["NonFiniteWatch"]


class NonFiniteWatch:
    """Watches this rank's stages; `check(loss)` after each training step."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        stage_ids: Sequence[int],
        num_stages: int,
        device: torch.device,
        policy: str,
    ) -> None:
        self.policy = policy
        self.stage_ids = list(stage_ids)
        self.num_stages = num_stages
        self.modules = list(modules)
        self.steps = 0  # train steps checked so far: the next one's number
        self.skipped: list[int] = []
        self._bad = torch.zeros(num_stages, dtype=torch.bool, device=device)
        for module, stage in zip(modules, stage_ids, strict=True):
            module.register_forward_hook(self._hook(stage))

    def start(self) -> None:
        """A training step begins: forget what evaluation forwards saw."""
        self._bad.zero_()

    def _hook(self, stage: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for leaf in _tensors(output):
                if leaf.is_floating_point():
                    self._bad[stage] |= ~torch.isfinite(leaf.detach()).all()

        return hook

    def check(self, loss: torch.Tensor) -> bool:
        """After step `self.steps`: True if the step must be skipped; raises under "raise".

        Every rank calls it with the same loss; the diagnosis is collective (every rank sees a
        bad loss together, so they enter it together).
        """
        step, self.steps = self.steps, self.steps + 1
        bad_outputs, self._bad = self._bad, torch.zeros_like(self._bad)
        if bool(torch.isfinite(loss)):
            return False
        where = self._diagnose(bad_outputs)
        if self.policy == "skip":
            self.skipped.append(step)
            return True
        raise FloatingPointError(
            f"non-finite loss ({float(loss)}) at training step {step} (counting from 0): "
            f"{where}. Lower the learning rate, clip gradients, check the data of this step, "
            "or set nonfinite='skip' to drop such steps."
        )

    def _diagnose(self, bad_outputs: torch.Tensor) -> str:
        weights = torch.zeros_like(bad_outputs)
        for module, stage in zip(self.modules, self.stage_ids, strict=True):
            weights[stage] = any(_nonfinite(p) for p in module.parameters())
        flags = torch.stack([bad_outputs, weights]).to(torch.int32)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        outputs, bad_weights = flags[0].tolist(), flags[1].tolist()
        if 1 not in outputs:
            return (
                "every stage's output was finite, so the loss function (on the last stage, "
                f"{self.num_stages - 1}) made it"
            )
        stage = outputs.index(1)
        held = (
            "its weights hold non-finite values" if bad_weights[stage] else "its weights are finite"
        )
        return f"the first non-finite output came from pipeline stage {stage} ({held})"


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a stage's output (a tensor, or tuples, lists and dicts of them)."""
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _nonfinite(param: torch.Tensor) -> bool:
    local = param.to_local() if hasattr(param, "to_local") else param
    return bool(local.numel()) and not bool(torch.isfinite(local.detach()).all())
