"""Train the bundled GPT on the bundled Markov language with ZeroPP on CPU ranks.

    python recipes/train.py                      # 4 CPU ranks: pp 2 x dp_shard 2, 300 steps
    python recipes/train.py --steps 50 --pp 4 --dp-shard 1 --schedule interleaved_1f1b

Lightning launches the ranks itself (it re-runs this script once per extra rank). The loss starts
near ln(256) = 5.55 and falls toward the language's entropy floor (printed at the start).
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.models import GPTConfig, MarkovLanguage, TokenDataset
from lightning_zeropp.models.lit_gpt import LitGPT


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks")
    p.add_argument("--dp-shard", type=int, default=2, help="ranks that shard each stage (FSDP2)")
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", default="outputs")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    world = args.pp * args.dp_shard * args.dp_replicate
    dp = args.dp_shard * args.dp_replicate
    per_rank = args.global_batch // dp
    model_cfg = GPTConfig()
    pl.seed_everything(0)
    train = TokenDataset.markov(
        args.steps * args.global_batch, model_cfg.seq_len, model_cfg.vocab_size
    )
    val = TokenDataset.markov(
        4 * args.global_batch, model_cfg.seq_len, model_cfg.vocab_size, stream=1
    )
    module = LitGPT(
        model_cfg,
        micro_batch_size=per_rank // args.microbatches,
        lr=args.lr,
        warmup_steps=args.steps // 10,
        max_steps=args.steps,
    )
    strategy = ZeroPPStrategy(
        pp_size=args.pp,
        dp_shard_size=args.dp_shard,
        dp_replicate_size=args.dp_replicate,
        schedule=args.schedule,
        num_microbatches=args.microbatches,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=args.steps,
        gradient_clip_val=1.0,
        val_check_interval=max(1, args.steps // 3),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=CSVLogger(args.out, name="zeropp"),
        enable_checkpointing=False,
        log_every_n_steps=10,
    )
    if trainer.is_global_zero:
        floor = MarkovLanguage(vocab_size=model_cfg.vocab_size).entropy()
        print(
            f"world {world} = pp {args.pp} x dp_replicate {args.dp_replicate} x dp_shard {args.dp_shard}; loss floor {floor:.3f}"
        )
    trainer.fit(
        module,
        DataLoader(train, batch_size=per_rank, shuffle=True, drop_last=True),
        DataLoader(val, batch_size=per_rank, drop_last=True),
    )
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"done: {metrics}")


if __name__ == "__main__":
    main()
