"""`ZeroPPRewardTrainer`: TRL's `RewardTrainer` pipelined (checked on TRL 1.16: `trl.CHECKED`).

TRL 1.16's `RewardTrainer.compute_loss` calls the sequence-classification model on a batch whose
first half is the chosen sequences and second half the rejected ones (`DataCollatorForPreference`),
takes the mean of `-logsigmoid(chosen - rejected [- margin])` over the pairs (plus
`center_rewards_coefficient` times the mean of `(chosen + rejected)**2`), and logs `accuracy`,
`margin`, `min_reward` / `mean_reward` / `max_reward` and `num_tokens`.

Under a pipeline the rewards exist on the last stage only, one micro-batch at a time: each
micro-batch must hold whole pairs. The schedule cuts a batch into contiguous row ranges, so the
rows are put in pair order first (`paired`): micro-batch k holds its pairs' chosen rows, then the
same pairs' rejected rows. The loss runs there (`core.step.last_loss`) as a sum over the
micro-batch's pairs divided by the global batch's pairs per micro-batch and data-parallel rank,
so the step's loss is the mean over every pair of the global batch, as one process computes it;
`accuracy`, `margin` and `mean_reward` are combined the same way, `min_reward` / `max_reward`
over every micro-batch and data-parallel rank (`_extremes`). The sequence-classification head
pools each row's last non-pad token from `input_ids`: under `split="call"` every stage runs the
model's own forward on the micro-batch's inputs, so the last stage has them.

Overridden TRL methods: `compute_loss` (the whole body), and, from `ZeroPPTrainer`, everything it
overrides of the Trainer. Evaluation runs the same loss forward-only (in as many micro-batches,
up to `num_microbatches`, as split the batch's rows): every process gets the global eval batch's
pair mean, TRL's metrics go to its "eval" set. Refused: `predict()` (the rewards exist on the
last stage only), a per-data-parallel-rank number of pairs that does not split into the
micro-batches, and `cp_size > 1` at construction (the head's pooling at each row's last
non-pad token would run on one CP rank's part of the sequence).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from trl import RewardConfig, RewardTrainer

from lightning_zeropp.accelerate.repeats import repeated_samples
from lightning_zeropp.core.schedule.build import eval_microbatches
from lightning_zeropp.transformers.counts import summed_over_data_parallel
from lightning_zeropp.transformers.trainer import ZeroPPTrainer
from lightning_zeropp.trl.adapters import is_peft
from lightning_zeropp.trl.mode import follow_pipeline_mode

__all__ = ["ZeroPPRewardTrainer", "paired", "reward_loss"]

_MARGIN = "margin"  # TRL's per-pair margin column (DataCollatorForPreference)
_IGNORED = -100  # the label of a row that counts nothing
_NO_CONTEXT = (
    "ZeroPPRewardTrainer: cp_size={cp} (context parallelism) is not supported: {model} pools "
    "each row at its last non-pad token inside its own forward, which under context parallelism "
    "sees one CP rank's part of the sequence only (that token is on one CP rank), so the rewards "
    "would be wrong. Set cp_size=1 (pp_size or dp_shard_size for the ranks)."
)
_NO_PREDICT = (
    "ZeroPPRewardTrainer: predict() is not supported: the rewards exist on the last stage only, "
    "one micro-batch at a time. Use evaluate() for the loss and TRL's metrics, or score with the "
    "saved model (trainer.save_model(dir)) in one process."
)


def paired(inputs: dict[str, Any], micro: int) -> dict[str, Any]:
    """The batch with its rows in pair order for `micro` micro-batches: micro-batch k holds the
    chosen rows of pairs [k*p, (k+1)*p), then the rejected rows of the same pairs (p = pairs /
    micro). Per-pair tensors (`margin`) keep their order: split alike, they stay with their pairs.
    TRL's collator puts all chosen rows first, which contiguous micro-batches would split apart."""
    rows = inputs["input_ids"].shape[0]
    pairs = rows // 2
    if rows % 2 or pairs % micro:
        raise ValueError(
            f"ZeroPPRewardTrainer: a batch of {pairs} chosen/rejected pairs ({rows} rows) does "
            f"not split into num_microbatches={micro} micro-batches of whole pairs; use a "
            f"per-device batch size (in pairs) that is a multiple of {micro}, and "
            "dataloader_drop_last=True."
        )
    per = pairs // micro
    order = torch.arange(rows).view(2, micro, per).transpose(0, 1).reshape(-1)
    out = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            value = value[order.to(value.device)]
        out[key] = value
    return out


def reward_loss(
    output: Any,
    labels: torch.Tensor,
    num_items_in_batch: float,
    center: float | None = None,
    margin: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's pairwise loss over one micro-batch in pair order (`paired`): its pairs' summed loss
    over `num_items_in_batch / 2` (the items are rows: two per pair); and the sums behind TRL's
    metrics, scaled alike. A pair whose labels are -100 (a sample Accelerate repeated to complete
    a short last evaluation batch) counts in nothing; the min and max of a micro-batch without a
    counted pair are +inf and -inf."""
    rewards = output["logits"].squeeze(-1)
    chosen, rejected = torch.chunk(rewards, chunks=2)
    real = torch.chunk(labels != _IGNORED, chunks=2)[0]
    weight = real.to(rewards.dtype)
    pairs = num_items_in_batch / 2
    diff = chosen - rejected
    shifted = diff - margin if margin is not None else diff
    loss = -(nn.functional.logsigmoid(shifted) * weight).sum() / pairs
    if center is not None:
        loss = loss + center * (((chosen + rejected) ** 2) * weight).sum() / pairs
    with torch.no_grad():
        counted = torch.cat([real, real])
        inf = torch.full_like(rewards, float("inf"))
        metrics = {
            "accuracy": ((chosen > rejected).float() * weight).sum() / pairs,
            "margin": (diff * weight).sum() / pairs,
            "mean_reward": (rewards * counted).sum() / num_items_in_batch,
            "min_reward": torch.where(counted, rewards, inf).min(),
            "max_reward": torch.where(counted, rewards, -inf).max(),
        }
    return loss, metrics


class ZeroPPRewardTrainer(ZeroPPTrainer, RewardTrainer):
    """`trl.RewardTrainer(...)` pipelined over FSDP2: TRL's arguments plus `zeropp_plugin`."""

    args: RewardConfig  # RewardTrainer's own arguments (center_rewards_coefficient, ...)

    def __init__(self, *args: Any, zeropp_plugin: Any = None, **kwargs: Any) -> None:
        self._extremes: list[torch.Tensor] = []  # the last stage's (min, -max) per micro-batch
        self._tokens = torch.zeros((), dtype=torch.long)  # this rank's batch's attention mask
        self._micro = 1  # micro-batches of the last call (a forward-only one may run fewer)
        super().__init__(*args, zeropp_plugin=zeropp_plugin, **kwargs)
        cp = self._zeropp_plugin.run_settings().config.cp_size
        if cp > 1:  # the same verdict on every rank: the settings and the model's class
            model: Any = self.model
            base = model.get_base_model() if is_peft(model) else model
            raise ValueError(_NO_CONTEXT.format(cp=cp, model=type(base).__name__))

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(_NO_PREDICT)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        follow_pipeline_mode(self.model, self._pipeline)  # TRL picks train/eval off self.model
        super().log(logs, start_time)

    def _default_args(self) -> Any:
        return RewardConfig(output_dir="tmp_trainer")

    def _last_stage_loss(self) -> tuple[Any, int] | None:
        return self._loss, 0

    def _loss(
        self, output: Any, labels: torch.Tensor, num_items_in_batch: float, **rows: Any
    ) -> Any:
        loss, metrics = reward_loss(
            output, labels, num_items_in_batch, self.args.center_rewards_coefficient, **rows
        )
        # min and max do not average over micro-batches: kept here, combined after the step
        self._extremes.append(torch.stack([metrics.pop("min_reward"), -metrics.pop("max_reward")]))
        return loss, metrics

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The pipeline's loss of the global batch, its rows in pair order, TRL's metrics
        recorded on the way (`_record_metrics`)."""
        pipeline = self._pipeline
        assert pipeline is not None
        micro = pipeline.engine.core.config.num_microbatches
        assert micro is not None
        if not model.training:  # forward only: as many micro-batches as split the pairs
            micro = eval_microbatches(max(1, inputs["input_ids"].shape[0] // 2), micro)
        self._micro = micro
        ids = inputs["input_ids"]
        labels = torch.ones(ids.shape[0], dtype=torch.long, device=ids.device)
        if not model.training:  # the pairs Accelerate repeated to complete a short last batch
            pairs = ids.shape[0] // 2
            dims = pipeline.engine.dims
            state = self.accelerator.gradient_state
            repeated = repeated_samples(state, dims.dp_rank, dims.dp_size, pairs)
            labels.view(2, -1)[:, pairs - repeated :] = _IGNORED  # chosen rows, then rejected
        rows = paired({**inputs, "labels": labels}, micro)
        margin = (_MARGIN,) if _MARGIN in rows else ()
        pipeline.use_loss(self._loss, shift=0, rows=margin, group=2)  # micro-batches: whole pairs
        self._extremes = []
        self._tokens = rows["attention_mask"].sum()
        return ZeroPPTrainer.compute_loss(self, model, rows, return_outputs, None)

    def _record_metrics(
        self, metrics: dict[str, float], inputs: dict[str, Any], training: bool
    ) -> None:
        """TRL's metrics of the global batch (as `RewardTrainer.compute_loss` logs them)."""
        assert self._pipeline is not None
        mode = "train" if training else "eval"
        low, high = self._combined_extremes()
        tokens = summed_over_data_parallel(
            self._tokens.to(self._pipeline.engine.device), self._pipeline
        )
        if training:
            self._total_train_tokens += int(tokens.item())
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        self._metrics[mode]["min_reward"].append(low)
        self._metrics[mode]["mean_reward"].append(metrics["mean_reward"])
        self._metrics[mode]["max_reward"].append(high)
        self._metrics[mode]["accuracy"].append(metrics["accuracy"])
        self._metrics[mode]["margin"].append(metrics["margin"])

    def _combined_extremes(self) -> tuple[float, float]:
        """Collective over the pipeline and data-parallel groups: the smallest and largest
        reward of the global batch, from the last stage's micro-batches (the last `micro`
        calls: torch's shape inference may call the loss once more, before them)."""
        assert self._pipeline is not None
        core, dims = self._pipeline.engine.core, self._pipeline.engine.dims
        micro = self._micro
        values = torch.zeros(2, dtype=torch.float64, device=core.device)
        if self._extremes:
            values = torch.stack(self._extremes[-micro:]).amin(0).to(torch.float64)
            values = values.to(core.device)
        if core.config.pp_size > 1:
            dist.broadcast(values, group=dims.pp_group, group_src=core.last_pp_rank)
        for group in dims.dp_groups:
            dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
        self._extremes = []
        return float(values[0]), -float(values[1])
