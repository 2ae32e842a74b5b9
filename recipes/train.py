# python recipes/train.py [group=option ...] [key=value ...]   (e.g. parallel=zeropp trainer.max_steps=50)
"""Train a causal LM with ZeroPP through Lightning, configured by Hydra from `conf/`.

With no arguments: the main job, the bundled GPT on the bundled Markov language on 4 CPU ranks
(pp 2 x dp_shard 2, 1F1B over FSDP2), 300 steps, a few minutes. Lightning starts the other ranks
itself (it re-runs this script with the same run directory); under torchrun or SLURM's srun each
process is one rank. The loss starts near ln(vocab_size) and falls toward the language's entropy
floor (printed at the start).

    python recipes/train.py parallel=zeropp trainer.max_steps=50
    python recipes/train.py cluster=h100_1x8 model=llama_1b parallel=zeropp data.seq_len=2048
    srun python recipes/train.py cluster=h100_4x8 model=llama_7b parallel=zeropp_plus

Writes into one run directory (outputs/<run id>/): `.hydra/` and `train.log` (rank 0 only),
`csv/metrics.csv` (Lightning's CSV logger) and `summary.json` (last logged values).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig
from recipe_config import (
    Plan,
    build_datasets,
    check_config,
    check_model_facts,
    fill_model_facts,
    load_source,
    plan_summary,
    rank_zero_overrides,
    run_dir_note,
)
from torch import nn
from torch.utils.data import DataLoader

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.models import GPT, MarkovLanguage
from lightning_zeropp.models.lit_gpt import LitGPT


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    plan = check_config(cfg)  # every rank, before any process group exists
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    pl.seed_everything(cfg.trainer.seed)  # one seed everywhere: every rank builds the same weights
    net = instantiate(cfg.model.net)
    fill_model_facts(cfg.model, net)  # hf_local: vocabulary and depth come from the checkpoint
    check_model_facts(cfg, plan.zeropp)
    train, val = build_datasets(cfg)
    trainer = pl.Trainer(
        accelerator=cfg.cluster.accelerator,
        devices=cfg.cluster.devices,
        num_nodes=cfg.cluster.num_nodes,
        strategy=ZeroPPStrategy(
            **plan.parallel,
            process_group_backend=cfg.cluster.process_group_backend,
            load_from=load_source(cfg),  # hf_local: each rank reads its own shards
        ),
        precision="32-true",
        max_steps=cfg.trainer.max_steps,
        gradient_clip_val=cfg.trainer.gradient_clip_val,
        # Validate every val_check_interval steps across epochs, and at least once at the end.
        val_check_interval=min(cfg.trainer.val_check_interval, cfg.trainer.max_steps),
        check_val_every_n_epoch=None,
        limit_val_batches=cfg.trainer.limit_val_batches,
        num_sanity_val_steps=0,
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        logger=CSVLogger(run_dir, name="", version="csv"),  # run_dir/csv/metrics.csv
        enable_checkpointing=False,
        default_root_dir=run_dir,
    )
    if trainer.is_global_zero:
        print(plan_summary(cfg, plan, sum(p.numel() for p in net.parameters())))
        if note := run_dir_note():
            print(f"warning: {note}")
        if cfg.data.name == "markov":
            floor = MarkovLanguage(vocab_size=cfg.model.vocab_size).entropy()
            print(f"loss floor (the Markov language's entropy) {floor:.3f}")
    # Each data-parallel rank loads rank_batch_size rows per step (the strategy's sampler
    # splits the data over data-parallel ranks only); the pipeline cuts them into micro-batches.
    start = time.monotonic()
    trainer.fit(
        lightning_module(net, cfg, plan),
        DataLoader(train, batch_size=plan.rank_batch_size, shuffle=True, drop_last=True),
        DataLoader(val, batch_size=plan.rank_batch_size, drop_last=True),
    )
    if trainer.is_global_zero:
        summary = {k: round(float(v), 5) for k, v in trainer.callback_metrics.items()}
        summary["seconds"] = round(time.monotonic() - start, 1)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"done: {summary}")


def lightning_module(net: nn.Module, cfg: DictConfig, plan: Plan) -> pl.LightningModule:
    """The bundled GPT goes into LitGPT (with its metrics); HF models into LitCausalLM."""
    t = cfg.trainer
    common: dict[str, Any] = {"micro_batch_size": plan.micro_batch_size, "lr": t.lr}
    common.update(optimizer=t.optimizer, weight_decay=t.weight_decay)
    if isinstance(net, GPT):
        return LitGPT(net, warmup_steps=t.warmup_steps, max_steps=t.max_steps, **common)
    from lightning_zeropp.models.lit_causal_lm import LitCausalLM

    return LitCausalLM(net, seq_len=cfg.data.seq_len, **common)


if __name__ == "__main__":
    # Ranks other than 0 compose the same config into the same run directory but write no files.
    sys.argv += rank_zero_overrides(sys.argv[1:])
    main()
