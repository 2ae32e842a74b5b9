# torchrun --standalone --nproc_per_node 4 recipes/train_accelerate.py [group=option ...] [key=value ...]
"""Train a causal LM with ZeroPP from a plain Accelerate loop, configured by Hydra from `conf/`.

The same `conf/` as the Lightning recipe (recipes/train.py), and the same defaults: the bundled
GPT on the bundled Markov language, 4 CPU ranks (pp 2 x dp_shard 2), 300 steps. Each process is
one rank (torchrun, `accelerate launch`, or srun + torchrun); `cluster.devices x num_nodes` must be
the number of processes launched.

    torchrun --standalone --nproc_per_node 4 recipes/train_accelerate.py parallel=zeropp
    torchrun --nnodes 4 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \\
        --rdzv-id $JOB_ID recipes/train_accelerate.py cluster=h100_4x8 model=llama_7b

Writes into one run directory (outputs/<torchrun rendezvous id>/): `.hydra/` and
`train_accelerate.log` (rank 0 only), `metrics.jsonl` (rank 0: one line per log / validation) and
`summary.json`.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
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

from lightning_zeropp.accelerate import prepare_pipeline
from lightning_zeropp.metrics import CausalLMMetrics
from lightning_zeropp.models import MarkovLanguage
from lightning_zeropp.models.lr import warmup_cosine

IGNORE_INDEX = -100


class LossAndMetrics:
    """The pipeline's loss function (last stage, once per micro-batch), which also feeds the
    validation metrics while `evaluating` is on. Only eval steps update them: the runtime's extra
    shape-inference call of the loss happens in training steps only."""

    def __init__(self, metrics: CausalLMMetrics) -> None:
        self.metrics = metrics
        self.evaluating = False

    def __call__(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = _logits(output)  # (batch, time, vocab)
        if self.evaluating:
            self.metrics.update(logits, targets)
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    plan = check_config(cfg)  # every rank, before any collective
    accelerator = Accelerator(
        cpu=cfg.cluster.accelerator == "cpu",
        # The loader yields global batches, split over data-parallel ranks only; the LR
        # scheduler then steps once per optimizer step.
        dataloader_config=DataLoaderConfiguration(split_batches=True),
    )
    _check_world(accelerator, plan)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    torch.manual_seed(cfg.trainer.seed)  # one seed everywhere: every rank builds the same weights
    net = instantiate(cfg.model.net)
    fill_model_facts(cfg.model, net)
    check_model_facts(cfg, plan.zeropp)
    train, val = build_datasets(cfg)
    if accelerator.is_main_process:
        print(plan_summary(cfg, plan, sum(p.numel() for p in net.parameters())), flush=True)
        if note := run_dir_note():
            print(f"warning: {note}", flush=True)
        if cfg.data.name == "markov":
            floor = MarkovLanguage(vocab_size=cfg.model.vocab_size).entropy()
            print(f"loss floor (the Markov language's entropy) {floor:.3f}", flush=True)

    t = cfg.trainer
    optimizer = _optimizer(net, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, t.warmup_steps, t.max_steps)
    )
    loss_fn = LossAndMetrics(CausalLMMetrics(cfg.model.vocab_size, prefix="val_"))
    train_dl = DataLoader(train, batch_size=plan.global_batch_size, shuffle=True, drop_last=True)
    engine, optimizer, train_dl, scheduler = prepare_pipeline(
        accelerator,
        net,
        optimizer,
        train_dl,
        scheduler,
        loss_fn=loss_fn,
        config=plan.zeropp,
        load_from=load_source(cfg),  # hf_local: each rank reads its own shards
    )
    del net  # the engine holds this rank's stages
    loss_fn.metrics.to(engine.device)
    val_dl = engine.prepare_data_loader(
        DataLoader(val, batch_size=plan.global_batch_size, drop_last=True)
    )
    log = _Log(run_dir / "metrics.jsonl", accelerator.is_main_process)

    start = time.monotonic()
    val_every = min(t.val_check_interval, t.max_steps)
    batches = itertools.chain.from_iterable(itertools.repeat(train_dl))  # epochs until max_steps
    for step, batch in zip(range(1, t.max_steps + 1), batches, strict=False):
        loss = engine.step(batch)  # global-batch mean loss, on every rank
        if t.gradient_clip_val is not None:
            engine.clip_grad_norm_(t.gradient_clip_val)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step % t.log_every_n_steps == 0 or step == t.max_steps:
            log.write(step=step, train_loss=float(loss), lr=scheduler.get_last_lr()[0])
        if step % val_every == 0 or step == t.max_steps:
            log.write(step=step, **_validate(engine, val_dl, loss_fn, t.limit_val_batches))
    summary = {**log.last, "seconds": round(time.monotonic() - start, 1)}
    if accelerator.is_main_process:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"done: {summary}", flush=True)
    accelerator.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()


def _validate(
    engine: Any, val_dl: DataLoader, loss_fn: LossAndMetrics, limit: int | None
) -> dict[str, float]:
    """Mean loss, perplexity and token accuracy over the validation batches, on every rank."""
    engine.eval()
    loss_fn.evaluating = True
    losses = [float(engine.eval_step(b)) for b in itertools.islice(val_dl, limit)]
    loss_fn.evaluating = False
    engine.train()
    values = loss_fn.metrics.compute()  # a collective over all ranks: every rank calls it
    loss_fn.metrics.reset()
    return {"val_loss": sum(losses) / max(len(losses), 1), **values}


def _optimizer(net: nn.Module, cfg: DictConfig) -> torch.optim.Optimizer:
    t = cfg.trainer
    if t.optimizer == "sgd":
        return torch.optim.SGD(net.parameters(), lr=t.lr)
    return torch.optim.AdamW(net.parameters(), lr=t.lr, eps=1e-6, weight_decay=t.weight_decay)


def _check_world(accelerator: Accelerator, plan: Plan) -> None:
    if accelerator.num_processes != plan.world_size:
        raise ValueError(
            f"the cluster config says {plan.world_size} processes (cluster.devices x "
            f"cluster.num_nodes) but {accelerator.num_processes} were launched; launch "
            f"`torchrun --nproc_per_node <cluster.devices> --nnodes <cluster.num_nodes> ...` or "
            "pick the matching cluster=..."
        )


def _logits(output: Any) -> torch.Tensor:
    """The last stage's logits: a tensor (bundled GPT, traced HF stage) or an HF output."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)):
        logits = output[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"cannot find logits in a last-stage output of type {type(output)}")
    return logits


class _Log:
    """Rank 0 prints and appends JSON lines; every rank keeps the last values (all equal)."""

    def __init__(self, path: Path, main: bool) -> None:
        self.path, self.main = path, main
        self.last: dict[str, float] = {}

    def write(self, **values: float) -> None:
        self.last.update(values)
        if self.main:
            line = json.dumps(
                {k: round(v, 6) if isinstance(v, float) else v for k, v in values.items()}
            )
            print(line, flush=True)
            with self.path.open("a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    # Ranks other than 0 compose the same config into the same run directory but write no files.
    sys.argv += rank_zero_overrides(sys.argv[1:])
    main()
