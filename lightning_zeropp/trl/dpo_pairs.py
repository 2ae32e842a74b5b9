"""DPO's pairs under a pipeline (`trl.dpo`): TRL's collated batch reordered so that each chosen
row is followed by its rejected row (`paired_batch`), so that a micro-batch of an even number of
rows holds whole pairs; and TRL's sigmoid DPO loss of such a micro-batch (`dpo_loss`), run on the
last stage from the logits: its pairs' summed loss over the global batch's pair count, and TRL's
metrics as sums over the micro-batch. Re-exported by `trl.dpo`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lightning_zeropp.trl.reference import completion_logps

__all__ = ["dpo_loss", "paired_batch"]


def paired_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """TRL's collated batch (`[chosen; rejected]` rows, per-pair reference log-probabilities) as
    the pipeline is called: rows alternating chosen, rejected of one pair; `labels` the
    completions' tokens (-100 elsewhere, as TRL's); `ref_logps` one per row; `counted` 1.0 per
    row (0.0 for a pair Accelerate repeated to complete a short last evaluation batch, set by
    `compute_loss`)."""
    ids, completion = batch["input_ids"], batch["completion_mask"]
    pairs = ids.size(0) // 2
    order = torch.arange(2 * pairs).view(2, pairs).t().reshape(-1)  # c0 r0 c1 r1 ...
    out = {
        "input_ids": ids[order],
        "attention_mask": batch["attention_mask"][order],
        "completion_mask": completion[order],
        "labels": ids.masked_fill(completion == 0, -100)[order],
        "counted": torch.ones(2 * pairs),
    }
    if "ref_chosen_logps" in batch:
        ref = torch.stack([batch["ref_chosen_logps"], batch["ref_rejected_logps"]], dim=1)
        out["ref_logps"] = ref.reshape(-1)
    else:  # filled by the reference forward of each step; here, so every call is alike
        out["ref_logps"] = torch.zeros(2 * pairs)
    return out


def dpo_loss(
    output: Any,
    labels: torch.Tensor,
    num_items_in_batch: float,
    completion_mask: torch.Tensor,
    ref_logps: torch.Tensor,
    beta: float,
    weight: float = 1.0,
    counted: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's sigmoid DPO loss of a micro-batch of whole pairs (rows chosen, rejected, ...), summed
    over its pairs and divided by `num_items_in_batch` (pairs); and its metrics as sums. A pair
    whose `counted` is 0 (a repeated sample) counts in neither."""
    logits = output["logits"][:, :-1].float()
    target = labels[:, 1:]
    rows = torch.ones(logits.shape[0], device=logits.device) if counted is None else counted
    mask = completion_mask[:, 1:].bool() & (rows[:, None] > 0)
    logp = logits.log_softmax(-1)
    logps = completion_logps(output, labels, completion_mask)
    chosen, rejected = logps[0::2], logps[1::2]
    real = rows[0::2].to(logps.dtype)
    chosen_ratio = chosen - ref_logps[0::2]
    rejected_ratio = rejected - ref_logps[1::2]
    per_pair = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    loss = (per_pair * real).sum() * weight / num_items_in_batch
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
        mean_logits = logits.mean(-1)
        hits = logits.argmax(-1) == target
        reward_c, reward_r = beta * chosen_ratio, beta * rejected_ratio
        c_mask, r_mask = mask[0::2], mask[1::2]
        metrics = {
            "pairs": real.sum(),
            "rewards_chosen": (reward_c * real).sum(),
            "rewards_rejected": (reward_r * real).sum(),
            "rewards_accuracies": ((reward_c > reward_r).float() * real).sum(),
            "rewards_margins": ((reward_c - reward_r) * real).sum(),
            "logps_chosen": (chosen * real).sum(),
            "logps_rejected": (rejected * real).sum(),
            "tokens": mask.sum().float(),
            "entropy_sum": (entropy * mask).sum(),
            "chosen_tokens": c_mask.sum().float(),
            "rejected_tokens": r_mask.sum().float(),
            "chosen_logits": (mean_logits[0::2] * c_mask).sum(),
            "rejected_logits": (mean_logits[1::2] * r_mask).sum(),
            "chosen_correct": (hits[0::2] & c_mask).sum().float(),
        }
    return loss, {k: v.detach().to(torch.float64) for k, v in metrics.items()}
