"""`ZeroPPSFTTrainer`: TRL's `SFTTrainer` pipelined (checked on TRL 1.16: `trl.CHECKED`).

TRL 1.16's `SFTTrainer.compute_loss` calls the model with its fused LM head (per-token
log-probabilities, entropy and top-1 hits from the last hidden state) and gathers its metrics
over every process. Under a pipeline that head exists on the last stage only, one micro-batch at
a time, so the same numbers are computed there from the logits, through the library's last-stage
loss (`core.step.last_loss`): the loss (`loss_type` "nll", or "dft"), and, as sums over the
micro-batch, the labelled tokens, their entropy and top-1 hits, which every rank turns into the
global batch's `entropy` and `mean_token_accuracy`. `num_tokens` is summed over the
data-parallel ranks only (the ranks of one pipeline share their rows). A `compute_loss_func` or
label smoothing is the loss instead, the metrics kept.

Overridden TRL methods: `compute_loss` (the whole body), and, from `ZeroPPTrainer`, everything it
overrides of the Trainer (its place first in the method order). Not supported, refused at
construction: MoE auxiliary losses (`router_aux_loss_coef`), `loss_type` other than "nll"/"dft".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from trl import SFTConfig, SFTTrainer

from lightning_zeropp.transformers.counts import summed_over_data_parallel
from lightning_zeropp.transformers.trainer import ZeroPPTrainer
from lightning_zeropp.trl.mode import drop_fused_head, follow_pipeline_mode

__all__ = ["ZeroPPSFTTrainer", "sft_metrics", "sft_loss"]

_LOSS_TYPES = ("nll", "dft")
# What TRL's padding-free collator adds to describe the packing (flash attention's): the pipeline
# regroups packed documents into its micro-batches, which would make them wrong; HF models read
# the documents from `position_ids`, which stay.
_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def sft_metrics(output: Any, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The micro-batch's labelled next-token positions, their entropy and top-1 hits (sums)."""
    with torch.no_grad():
        logits = output["logits"][:, :-1].float()
        target = labels[:, 1:]
        keep = target != -100
        logp = logits.log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        hits = (logits.argmax(-1) == target) & keep
        return {
            "valid": keep.sum().to(torch.float64),
            "entropy_sum": (entropy * keep).sum().to(torch.float64),
            "correct": hits.sum().to(torch.float64),
        }


def sft_loss(
    output: Any, labels: torch.Tensor, num_items_in_batch: float, dft: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's SFT loss from the logits: the labelled tokens' negative log-probabilities (times
    their probability for DFT), summed over `num_items_in_batch`; and `sft_metrics`."""
    logits = output["logits"][:, :-1].float()
    target = labels[:, 1:]
    keep = target != -100
    picked = logits.log_softmax(-1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
    per_token = -picked * keep
    if dft:
        per_token = per_token * picked.exp().detach()
    return per_token.sum() / num_items_in_batch, sft_metrics(output, labels)


def _with_metrics(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A user's loss (`compute_loss_func`, label smoothing) with TRL's metrics beside it."""

    def loss(output: Any, labels: torch.Tensor, num_items_in_batch: float) -> Any:
        value = fn(output, labels, num_items_in_batch=num_items_in_batch)
        return value, sft_metrics(output, labels)

    return loss


def _without_packing_keys(batch: Any) -> Any:
    if not isinstance(batch, dict) or "position_ids" not in batch:
        return batch
    return {k: v for k, v in batch.items() if k not in _PACKING_KEYS}


class ZeroPPSFTTrainer(ZeroPPTrainer, SFTTrainer):
    """`trl.SFTTrainer(...)` pipelined over FSDP2: TRL's arguments plus `zeropp_plugin`."""

    args: SFTConfig  # SFTTrainer's own arguments (loss_type, ...)

    def __init__(self, *args: Any, zeropp_plugin: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, zeropp_plugin=zeropp_plugin, **kwargs)
        if self.args.loss_type not in _LOSS_TYPES:
            raise ValueError(
                f"ZeroPPSFTTrainer: loss_type={self.args.loss_type!r} is not pipelined; use one "
                f"of {', '.join(_LOSS_TYPES)}."
            )
        collate = self.data_collator
        self.data_collator = lambda rows: _without_packing_keys(collate(rows))
        drop_fused_head(self.model)  # a PEFT model's stages would reach the original model
        if self.aux_loss_enabled:
            raise ValueError(
                "ZeroPPSFTTrainer: the MoE router's auxiliary loss (router_aux_loss_coef) is not "
                "pipelined yet. Set router_aux_loss_coef=0.0."
            )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        follow_pipeline_mode(self.model, self._pipeline)  # TRL picks train/eval off self.model
        super().log(logs, start_time)

    def _default_args(self) -> Any:
        return SFTConfig(output_dir="tmp_trainer")

    def _last_stage_loss(self) -> tuple[Any, int] | None:
        own = super()._last_stage_loss()
        if own is not None:
            return _with_metrics(own[0]), own[1]
        return (lambda o, y, num_items_in_batch: sft_loss(
            o, y, num_items_in_batch, dft=self.args.loss_type == "dft"
        )), 1  # fmt: skip

    def _record_metrics(
        self, metrics: dict[str, float], inputs: dict[str, Any], training: bool
    ) -> None:
        """TRL's metrics of the global batch (as `SFTTrainer.compute_loss` logs them)."""
        mode = "train" if training else "eval"
        valid = metrics.get("valid", 0.0)
        entropy = metrics["entropy_sum"] / valid if valid > 0 else 0.0
        accuracy = metrics["correct"] / valid if valid > 0 else 0.0
        self._metrics[mode]["entropy"].append(entropy)
        self._metrics[mode]["mean_token_accuracy"].append(accuracy)
        if training:
            self._total_train_tokens += self._tokens(inputs)
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]

    def _tokens(self, inputs: dict[str, Any]) -> int:
        """Tokens of the global batch, as TRL counts them: attention mask, else row length."""
        assert self._pipeline is not None
        if "attention_mask" in inputs:
            local = inputs["attention_mask"].sum()
        elif "position_ids" in inputs:
            local = torch.tensor(inputs["position_ids"].size(1))
        else:
            raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
        local = local.to(self._pipeline.engine.device)
        return int(summed_over_data_parallel(local, self._pipeline).item())

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The pipeline's loss (`ZeroPPTrainer.compute_loss`; the metrics recorded on the way)."""
        return ZeroPPTrainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
