"""`ZeroPPDPOTrainer`: TRL's `DPOTrainer` pipelined (checked on TRL 1.16: `trl.CHECKED`).

TRL 1.16's `DPOTrainer.compute_loss` calls the model on `[chosen rows; rejected rows]` with its
fused LM head (per-token log-probabilities, entropy, mean logit and top-1 hits), sums each
completion's log-probabilities, takes the DPO loss against the reference's sums and gathers its
metrics over every process. Under a pipeline the head exists on the last stage only, one
micro-batch at a time, so the same numbers are computed there from the logits, through the
library's last-stage loss (`core.step.last_loss`), in `dpo_loss` (`dpo_pairs.py`):
- the batch's rows are reordered so that each chosen row is followed by its rejected row
  (`paired_batch`, the collator's last step): a micro-batch of an even number of rows then
  holds whole pairs, which the loss needs (it is not a sum over rows);
- the loss of a micro-batch is its pairs' summed sigmoid loss over the global batch's pair
  count divided by micro-batches and data-parallel ranks, so the step's loss is the global
  batch's pair mean, as one process's;
- the metrics are sums over the micro-batch (pairs, rewards, log-probabilities, completion
  tokens, their entropy, mean logit and top-1 hits), which every rank turns into TRL's
  `rewards/*`, `logps/*`, `logits/*`, `entropy` and `mean_token_accuracy` of the global batch
  (`num_tokens` summed over data-parallel ranks only).

The reference log-probabilities are either TRL's precomputed ones (`precompute_ref_log_probs=True`:
TRL's reference pass runs in every process on the whole model before it is split, over the whole
dataset; TRL's cache file of the results is not written), or, `DPOConfig`'s default, the reference
model TRL builds (the `ref_model` given, else the policy's path loaded) run forward-only each step
through the policy's own pipeline with its weights swapped into the stages (`reference.py`). With
LoRA adapters (`peft_config=LoraConfig(...)`) TRL's reference is the policy with its adapters
disabled: every `lora_B` zero, swapped into the stages the same way (`adapters.py`); TRL's
precomputed pass disables them itself. Refused at construction, on every rank: `sync_ref_model`,
`loss_type`s other than "sigmoid", `ld_alpha`, `f_divergence_type` other than "reverse_kl",
`use_weighting`, activation offloading, an MoE auxiliary loss, PEFT other than plain LoRA adapters
(`dpo_checks.py`, `adapters.py`); `predict()` raises (TRL's reads logits its fused head lacks).
Evaluation runs the same loss forward-only: every process gets the global eval batch's pair mean,
TRL's metrics go to its "eval" set. Under context parallelism (`cp_size > 1`) the last stage's
logits are gathered into whole sequences on every CP rank before `dpo_loss` (and the reference's
sums) run (`accelerate.last_loss`): CP splits the sequence, not the rows, so the pairs, the
`counted` rows and the reference's per-row values are as at cp 1; rows are padded to a multiple
of 2 x cp_size by TRL's collator (`DPOConfig(pad_to_multiple_of=...)`).

Overridden TRL methods: `compute_loss` (the whole body), `_precompute_ref_logps` (the whole body), and,
from `ZeroPPTrainer`, everything it overrides of the Trainer (its place first in the method order).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from datasets import Dataset
from torch import nn
from torch.utils.data import DataLoader
from trl import DPOConfig, DPOTrainer

from lightning_zeropp.accelerate.repeats import repeated_samples
from lightning_zeropp.accelerate.steps import NUM_ITEMS
from lightning_zeropp.core.schedule.build import eval_microbatches
from lightning_zeropp.fronts.microbatches import loss_shares
from lightning_zeropp.transformers.counts import summed_over_data_parallel
from lightning_zeropp.transformers.trainer import ZeroPPTrainer
from lightning_zeropp.trl.adapters import adapters_off, is_peft, wrapped_refusal
from lightning_zeropp.trl.dpo_checks import NO_PREDICT, extra_reference_weights, refusals
from lightning_zeropp.trl.dpo_pairs import dpo_loss, paired_batch
from lightning_zeropp.trl.mode import drop_fused_head, follow_pipeline_mode
from lightning_zeropp.trl.reference import FrozenReference, reference_logps

__all__ = ["ZeroPPDPOTrainer", "dpo_loss", "paired_batch"]

# The per-row tensors the last-stage loss reads besides the labels
_ROWS = ("completion_mask", "ref_logps", "counted")


class ZeroPPDPOTrainer(ZeroPPTrainer, DPOTrainer):
    """`trl.DPOTrainer(...)` pipelined over FSDP2: TRL's arguments plus `zeropp_plugin`."""

    args: DPOConfig  # DPOTrainer's own arguments (beta, loss_type, ...)

    def __init__(self, *args: Any, zeropp_plugin: Any = None, **kwargs: Any) -> None:
        init = inspect.signature(DPOTrainer).bind(*args, **kwargs).arguments
        for problem in refusals(init.get("args"), init):
            raise ValueError(f"ZeroPPDPOTrainer: {problem}")
        super().__init__(*args, zeropp_plugin=zeropp_plugin, **kwargs)
        if self.aux_loss_enabled:
            raise ValueError(
                "ZeroPPDPOTrainer: the MoE router's auxiliary loss (router_aux_loss_coef) is not "
                "pipelined yet. Set router_aux_loss_coef=0.0."
            )
        wrapped = wrapped_refusal(self.model, self.args.disable_dropout)  # TRL's PeftModel
        if wrapped is not None:
            raise ValueError(f"ZeroPPDPOTrainer: {wrapped}")
        collate = self._trl_collator = self.data_collator  # TRL's (its reference pass's too)
        self.data_collator = lambda rows: paired_batch(collate(rows))
        # The reference run each step: TRL's reference model (the ref_model given, else the
        # policy's path loaded), kept as weights only until the pipeline's shards exist; or,
        # for a LoRA policy, its adapters disabled: every lora_B zero (`adapters.py`).
        self._reference: FrozenReference | None = None
        self._ref_state: dict[str, torch.Tensor] | None = None
        self._adapters_off = is_peft(self.model) and not self.precompute_ref_logps
        if not self.precompute_ref_logps and not self._adapters_off:
            assert self.ref_model is not None  # TRL built one
            self._ref_state = dict(self.accelerator.unwrap_model(self.ref_model).state_dict())
            policy = self.accelerator.unwrap_model(self.model).state_dict()
            extra = extra_reference_weights(self._ref_state, policy)
            if extra is not None:
                raise ValueError(extra)
            self.ref_model = None  # its weights live in _reference from the pipeline's build on

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        follow_pipeline_mode(self.model, self._pipeline)  # TRL picks train/eval off self.model
        super().log(logs, start_time)

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        """TRL's reference pass (`compute_ref_log_probs`, its collator, batch size and order) on
        the whole model before it is split, in every process over every row: nothing to shard,
        gather or exchange through TRL's cache file (a temporary file per process for a dataset
        built in memory)."""
        if self._pipeline is not None:  # evaluate(dataset): TRL's pass needs the whole model
            raise ValueError(
                "ZeroPPDPOTrainer: evaluate(dataset) with precompute_ref_log_probs=True once the "
                "pipeline is built: the model's weights moved into its stages, so TRL's reference "
                "pass over the whole model cannot run. Pass the dataset as eval_dataset at "
                "construction, or set precompute_ref_log_probs=False (the reference run each step)."
            )
        if not isinstance(dataset, Dataset):
            raise ValueError(
                "ZeroPPDPOTrainer: precompute_ref_log_probs=True needs a map-style Dataset, got "
                f"{type(dataset).__name__} (as TRL's DPOTrainer)."
            )
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            collate_fn=getattr(self, "_trl_collator", self.data_collator),
            shuffle=False,
        )
        model = self.ref_model or self.model
        chosen, rejected = [], []
        for batch in loader:
            ref_chosen, ref_rejected = self.compute_ref_log_probs(model, batch)
            chosen.append(ref_chosen.cpu())
            rejected.append(ref_rejected.cpu())
        dataset = dataset.add_column("ref_chosen_logps", torch.cat(chosen).tolist())
        return dataset.add_column("ref_rejected_logps", torch.cat(rejected).tolist())

    def _build_pipeline(self, loader: Any) -> Any:
        # here, not at construction: TRL's precomputed pass (evaluate(dataset) too) calls it
        drop_fused_head(self.model)  # a PEFT model's stages would reach the original model
        prepared = super()._build_pipeline(loader)
        assert self._pipeline is not None
        weight = (self.loss_weights or [1.0])[0]
        beta = self.beta

        def loss(output: Any, labels: torch.Tensor, num_items_in_batch: float, **rows: Any) -> Any:
            return dpo_loss(output, labels, num_items_in_batch, beta=beta, weight=weight, **rows)

        self._pipeline.use_loss(loss, shift=1, rows=_ROWS, group=2)  # a micro-batch: whole pairs
        if self._ref_state is not None:
            params = list(self._pipeline.engine.named_parameters())
            self._reference = FrozenReference(params, self._ref_state)
            self._ref_state = None
        if self._adapters_off:  # TRL's `use_adapter(model, None)`: lora_B zero in the stages
            self._reference = FrozenReference(
                *adapters_off(list(self._pipeline.engine.named_parameters()))
            )
        return prepared

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(NO_PREDICT)

    def _last_stage_loss(self) -> tuple[Any, int] | None:
        return None  # DPO's own (`_build_pipeline`): TRL's DPO ignores compute_loss_func

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The pipeline's DPO loss of the global batch: its pair mean (TRL's), the metrics
        recorded on the way. The Trainer divides it by the accumulation steps (TRL's
        `loss_is_scaled_for_ga = False`), as for one process."""
        pipeline = self._pipeline
        assert pipeline is not None
        engine = pipeline.engine
        micro = engine.config.num_microbatches
        pairs = inputs["input_ids"].size(0) // 2
        if not model.training:  # forward only: as many micro-batches as split the pairs
            micro = eval_microbatches(pairs, micro)
        if pairs % micro != 0:
            which = "train" if model.training else "eval"
            raise ValueError(
                f"ZeroPPDPOTrainer: a batch of {pairs} pairs does not split into {micro} "
                "micro-batches of whole pairs (a pair's chosen and rejected rows must meet in one "
                f"micro-batch). Make per_device_{which}_batch_size x pp_size x cp_size a multiple of "
                "num_microbatches (and drop a short last batch: dataloader_drop_last=True)."
            )
        if self._reference is not None:  # TRL's reference forward, through the pipeline
            ref = reference_logps(pipeline, dict(inputs), self._reference)
            inputs = {**inputs, "ref_logps": ref}
        if not model.training:  # the pairs Accelerate repeated to complete a short last batch
            dims = engine.dims
            state = self.accelerator.gradient_state
            real = pairs - repeated_samples(state, dims.dp_rank, dims.dp_size, pairs)
            counted = inputs["counted"].clone()
            counted[2 * real :] = 0.0  # rows alternate chosen, rejected
            inputs = {**inputs, "counted": counted}
        else:
            real = pairs
        local = torch.tensor(float(real), device=engine.device)
        total = float(summed_over_data_parallel(local, pipeline).item())
        if not model.training:  # evaluation: the global batch's pair mean on every process
            # a last-stage loss runs on whole sequences, the same on every CP rank
            shares = loss_shares(micro, engine.dims, cp_parts=False)
            inputs = {**inputs, NUM_ITEMS: total / shares}
            keep, pipeline.eval_logits = pipeline.eval_logits, False  # TRL's fused head has none
            try:
                outputs = pipeline(**inputs)
            finally:
                pipeline.eval_logits = keep
            self._record_metrics(outputs.metrics, inputs, training=False)
            return (outputs["loss"], outputs) if return_outputs else outputs["loss"]
        # the Trainer's last-stage step: the pair count per micro-batch and data-parallel rank
        return self._last_stage_step(pipeline, model, inputs, return_outputs, total)

    def _record_metrics(
        self, metrics: dict[str, float], inputs: dict[str, Any], training: bool
    ) -> None:
        """TRL's metrics of the global batch (as `DPOTrainer.compute_loss` logs them)."""
        mode = "train" if training else "eval"
        log = self._metrics[mode]

        def ratio(num: str, den: str) -> float:
            return metrics[num] / metrics[den] if metrics[den] > 0 else 0.0

        log["entropy"].append(ratio("entropy_sum", "tokens"))
        if training:
            self._total_train_tokens += self._tokens(inputs)
        log["num_tokens"] = [self._total_train_tokens]
        log["logits/chosen"].append(ratio("chosen_logits", "chosen_tokens"))
        log["logits/rejected"].append(ratio("rejected_logits", "rejected_tokens"))
        log["mean_token_accuracy"].append(ratio("chosen_correct", "chosen_tokens"))
        for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
            log[name].append(ratio(name.replace("/", "_"), "pairs"))
        log["logps/chosen"].append(ratio("logps_chosen", "pairs"))
        log["logps/rejected"].append(ratio("logps_rejected", "pairs"))

    def _tokens(self, inputs: dict[str, Any]) -> int:
        """Tokens of the global batch, as TRL counts them (attention mask), over data-parallel
        ranks only (the ranks of one pipeline share their rows)."""
        assert self._pipeline is not None
        local = inputs["attention_mask"].sum().to(self._pipeline.engine.device)
        return int(summed_over_data_parallel(local, self._pipeline).item())
