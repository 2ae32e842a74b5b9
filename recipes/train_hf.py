# torchrun --standalone --nproc_per_node 4 recipes/train_hf.py model.net.path=DIR [key=value ...]
"""Fine-tune a local HF causal-LM directory through transformers' Trainer, pipelined by ZeroPP.

The model comes from `model=hf_local` (`model.net.path`, a directory `from_pretrained` reads),
the data, cluster, layout and training settings from the main job's groups (conf/config.yaml,
conf/train_hf.yaml); the script is an ordinary Trainer script with `ZeroPPTrainer` in place of
`Trainer`. With `model.net.empty` (the default) the model is built on the meta device and each
rank reads only its own shards of the directory (`ZeroPPPlugin(load_from=...)`).

    torchrun --standalone --nproc_per_node 4 recipes/train_hf.py model.net.path=/models/llama
    accelerate launch --multi_gpu --num_processes 4 recipes/train_hf.py model.net.path=/models/llama

Writes into one run directory (outputs/<torchrun rendezvous id>/): `.hydra/` and
`train_hf.log` (rank 0 only), `metrics.jsonl` (the Trainer's logs, rank 0), `summary.json`,
`model/` (an HF directory `from_pretrained` reads; adapters only with `hf.lora`) and, with
`hf.save_steps`, the Trainer's sharded checkpoints under `trainer/`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from recipe_config import (
    Plan,
    build_datasets,
    check_config,
    check_model_facts,
    fill_model_facts,
    plan_summary,
    rank_zero_overrides,
    run_dir_note,
)
from torch.utils.data import Dataset, Subset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

from lightning_zeropp.fronts.packing import check_buckets
from lightning_zeropp.transformers import ZeroPPPlugin, ZeroPPTrainer


class Rows(Dataset):
    """A token-window dataset as the Trainer reads one: dicts of `input_ids` and `labels` (the
    model shifts labels itself)."""

    def __init__(self, windows: Any) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = self.windows[i][0]
        return {"input_ids": tokens, "labels": tokens}


class JsonLines(TrainerCallback):
    """The Trainer's logs, one JSON line each, appended by the main process."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.last: dict[str, float] = {}

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        line = {"step": state.global_step, **(logs or {})}
        self.last.update(line)
        if state.is_world_process_zero:
            with self.path.open("a") as f:
                f.write(json.dumps(line) + "\n")


@hydra.main(config_path="../conf", config_name="train_hf", version_base="1.3")
def main(cfg: DictConfig) -> None:
    plan = check_config(cfg)  # every rank, before anything distributed
    lora = _check_hf(cfg, plan)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    torch.manual_seed(cfg.trainer.seed)  # adapters: the same initial values on every rank
    model, load_from = _build_model(cfg, lora)
    fill_model_facts(cfg.model, getattr(model, "base_model", model))
    check_model_facts(cfg, plan.zeropp)
    train, val = build_datasets(cfg)
    t = cfg.trainer
    per_device = plan.global_batch_size // plan.world_size
    if t.limit_val_batches is not None:  # rows of that many evaluation steps
        val = Subset(val, range(min(len(val), t.limit_val_batches * per_device * plan.world_size)))
    args = TrainingArguments(
        output_dir=str(run_dir / "trainer"),
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device,
        max_steps=t.max_steps,
        learning_rate=t.lr,
        weight_decay=t.weight_decay,
        optim="sgd" if t.optimizer == "sgd" else "adamw_torch",
        lr_scheduler_type="cosine_with_min_lr",  # the other recipes' warm-up, then cosine to 10%
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=t.warmup_steps,
        max_grad_norm=t.gradient_clip_val or 0.0,
        logging_steps=t.log_every_n_steps,
        eval_strategy="steps",
        eval_steps=min(t.val_check_interval, t.max_steps),
        save_strategy="steps" if cfg.hf.save_steps else "no",
        save_steps=cfg.hf.save_steps or 500,
        seed=t.seed,
        use_cpu=cfg.cluster.accelerator == "cpu",
        report_to=[],
        disable_tqdm=True,
    )
    log = JsonLines(run_dir / "metrics.jsonl")
    plugin = ZeroPPPlugin(plan.zeropp, load_from=load_from, seq_buckets=cfg.hf.seq_buckets)
    trainer = ZeroPPTrainer(
        model=model,
        args=args,
        train_dataset=Rows(train),
        eval_dataset=Rows(val),
        data_collator=default_data_collator,
        callbacks=[log],
        zeropp_plugin=plugin,
    )
    if trainer.is_world_process_zero():
        num_params = sum(p.numel() for p in model.parameters())
        print(plan_summary(cfg, plan, num_params), flush=True)
        if note := run_dir_note():
            print(f"warning: {note}", flush=True)
    trainer.train(resume_from_checkpoint=cfg.hf.resume_from)
    trainer.save_model(str(run_dir / "model"))
    summary = {k: v for k, v in log.last.items() if isinstance(v, (int, float))}
    if "eval_loss" in summary:
        summary["eval_perplexity"] = math.exp(summary["eval_loss"])
    if trainer.is_world_process_zero():
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"done: {summary}", flush=True)
    trainer.end()


def _check_hf(cfg: DictConfig, plan: Plan) -> dict[str, Any] | None:
    """The `hf` group and what the Trainer needs of the layout, checked on every rank."""
    if cfg.model.name != "hf_local":
        raise ValueError(
            f"model={cfg.model.name}: recipes/train_hf.py fine-tunes an HF model directory; use "
            "model=hf_local model.net.path=/path/to/model (recipes/train.py trains the others)."
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.world_size:
        raise ValueError(
            f"the cluster config says {plan.world_size} processes (cluster.devices x "
            f"cluster.num_nodes) but {world} were launched; launch `torchrun --nproc_per_node "
            "<cluster.devices> ...` or pick the matching cluster=..."
        )
    if plan.global_batch_size % plan.world_size:
        raise ValueError(
            f"the global batch of {plan.global_batch_size} rows (trainer.micro_batch_size x "
            f"parallel.num_microbatches x data-parallel size) does not split into "
            f"{plan.world_size} per-process batches, as the Trainer's per_device_train_batch_"
            "size needs; choose trainer.micro_batch_size x parallel.num_microbatches divisible "
            "by parallel.pp_size."
        )
    check_buckets(OmegaConf.to_container(cfg.hf, resolve=True).get("seq_buckets"))
    lora = cfg.hf.lora
    return None if lora is None else dict(OmegaConf.to_container(lora, resolve=True))


def _build_model(cfg: DictConfig, lora: dict[str, Any] | None) -> tuple[Any, str | None]:
    """The model as a Trainer script builds it, and where its shards come from (or None)."""
    path = str(cfg.model.net.path)
    if cfg.model.net.get("empty") and lora is None:
        from accelerate import init_empty_weights

        with init_empty_weights():  # parameters on meta: each rank reads its own shards
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        return model, path
    model = AutoModelForCausalLM.from_pretrained(path)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**lora))
    return model, None


if __name__ == "__main__":
    # Ranks other than 0 compose the same config into the same run directory but write no files.
    sys.argv += rank_zero_overrides(sys.argv[1:])
    main()
