"""Perplexity and token accuracy of a causal LM, correct under pipeline and data parallelism.

Under a pipeline only the last stage sees logits, and it sees them one micro-batch at a time. The
metrics here keep sum states only (negative log-likelihood and token counts for torchmetrics'
`Perplexity`, true positives and the rest for its micro-averaged `MulticlassAccuracy`), so:

- `update(logits, targets)` is called on whichever rank holds the last stage, once per real
  micro-batch; it communicates nothing (no `dist_sync_on_step`: a collective made by the last
  stage alone would wait forever for the other stages);
- `compute()` is called on *every* rank of `process_group` (default: the whole world), e.g. from
  `on_validation_epoch_end`. It sums the states over that group. Ranks that hold no last stage
  contribute zeros, so a sum over the whole world is the sum over the last stage's data-parallel
  ranks: each data-parallel replica's pipeline has exactly one last stage. Every rank gets the
  same values, which is what rank 0 logs;
- tokens whose target is `ignore_index` count in neither metric (padding, prompt tokens), and the
  result is the token-weighted value over the whole epoch, not a mean of micro-batch means.

Do not update from the pipeline runtime's shape-inference call of the loss function (it runs on
placeholder tensors on the first training step and after each eval->train switch); eval steps make
no such call, so validation metrics updated inside the loss / validation step are exact.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

__all__ = ["CausalLMMetrics"]


class CausalLMMetrics(nn.Module):
    """Perplexity and next-token accuracy over `vocab_size` classes, skipping `ignore_index`.

    Args:
        vocab_size: number of classes (the logits' last dimension).
        ignore_index: target value that marks tokens to leave out (PyTorch's default -100).
        process_group: the group `compute()` sums over; every member must call `compute()`.
            Default: the whole world, which is right for pipelines (see the module docstring).
        prefix: prepended to the names `compute()` returns, e.g. "val_".
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        ignore_index: int = -100,
        process_group: dist.ProcessGroup | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size!r} must be an integer >= 2.")
        if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
            raise ValueError(f"ignore_index={ignore_index!r} must be an integer.")
        self.vocab_size, self.ignore_index, self.prefix = vocab_size, ignore_index, prefix
        common: dict[str, Any] = {"process_group": process_group, "dist_sync_on_step": False}
        self.perplexity = Perplexity(ignore_index=ignore_index, **common)
        # Sums of many token log-likelihoods: float64 keeps the epoch total exact to ~1e-12, so the
        # result does not depend on how the tokens were split over ranks and micro-batches.
        self.perplexity.set_dtype(torch.float64)
        self.token_accuracy = MulticlassAccuracy(
            num_classes=vocab_size, average="micro", ignore_index=ignore_index, **common
        )

    def _metrics(self) -> dict[str, Metric]:
        return {"perplexity": self.perplexity, "token_accuracy": self.token_accuracy}

    @torch.no_grad()
    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Add one (micro-)batch: logits (batch, time, vocab), targets (batch, time) token ids."""
        if logits.dim() != 3 or targets.shape != logits.shape[:2]:
            raise ValueError(
                f"expected logits (batch, time, vocab) and targets (batch, time); got logits "
                f"{tuple(logits.shape)} and targets {tuple(targets.shape)}."
            )
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[-1]} classes but vocab_size={self.vocab_size}."
            )
        logits, targets = logits.detach(), targets.detach().long()
        # Softmax in fp32 at least: bf16 logits would round small probabilities to zero (log -> inf).
        self.perplexity.update(logits.float(), targets)
        # Labels, not logits: the micro-averaged accuracy only needs the argmax; (batch*time,)
        self.token_accuracy.update(logits.argmax(-1).flatten(), targets.flatten())

    def compute(self) -> dict[str, float]:
        """Token-weighted values over everything updated since the last reset, summed over
        `process_group`. A collective: call it on every rank of the group, then `reset()`."""
        with warnings.catch_warnings():
            # Ranks without the last stage never update: by design, their zero states are the
            # identity of the sum. torchmetrics would warn about it on every such rank.
            warnings.filterwarnings("ignore", message=r".*compute.* was called before the .*update")
            return {self.prefix + name: float(m.compute()) for name, m in self._metrics().items()}

    def reset(self) -> None:
        for metric in self._metrics().values():
            metric.reset()

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Same as `update` (never the per-batch compute-and-sync of torchmetrics' forward)."""
        self.update(logits, targets)
