"""TRL's SFT, Reward and DPO trainers: TRL's own under DDP against ZeroPP's, on the same machine.

    python bench/bench_trl.py [--steps 8] [--warmup 2] [--repeats 1] [--rows sft_ddp,...]

The same tiny HF Llama (`AutoConfig.for_model("llama", ...)`, 4 layers, hidden 128), the same
tokenized rows (prompt-completion rows of 24-48 tokens for SFT, chosen/rejected pairs of the same
lengths for Reward and DPO), per-device batch 4 on 2 gloo CPU ranks (one thread each): a global
batch of 8 rows (pairs), AdamW, fp32. Rows, per trainer:

- `<trainer>_ddp`: TRL's own trainer (`SFTTrainer`, `RewardTrainer`, `DPOTrainer`), which the
  Trainer wraps in DDP over the 2 processes;
- `<trainer>_zeropp`: `ZeroPPSFTTrainer`, `ZeroPPRewardTrainer`, `ZeroPPDPOTrainer` with
  `zeropp_plugin=ZeroPPPlugin(pp_size=2, num_microbatches=2)` (pp 2 on the 2 processes: each
  pipeline loads the global batch; DPO's reference log-probabilities precomputed in both).

Per rank and step (a callback's `on_step_begin` to `on_step_end`) the wall time; per row the
slowest rank per step, median over the timed steps. Results: bench/results/trl.md and .json.
Timings on a shared machine move with its load: the header gives the load average at the start.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

WORLD = 2
LLAMA = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
PIPE = {"pp_size": 2, "num_microbatches": 2}
TRAINERS = {"sft": "SFTTrainer", "reward": "RewardTrainer", "dpo": "DPOTrainer"}
ROWS = {
    f"{t}_{kind}": (f"TRL's {cls}: DDP over 2 processes" if kind == "ddp" else
                    f"ZeroPP{cls}: pp 2, 2 micro-batches")
    for t, cls in TRAINERS.items() for kind in ("ddp", "zeropp")
}  # fmt: skip
BATCH = 4  # per device (DDP); a pipeline of 2 loads 2 x 4: the same global batch


def row_timeout_s(steps: int) -> float:
    return harness.row_timeout_s(steps, start_s=300.0, per_step_s=30.0)


def _data(trainer: str, n: int) -> Any:
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)

    def ids(low: int, high: int) -> list[int]:
        length = int(torch.randint(low, high + 1, (), generator=g))
        return torch.randint(1, LLAMA["vocab_size"], (length,), generator=g).tolist()

    if trainer == "sft":
        rows = [ids(24, 48) for _ in range(n)]
        masks = [[0] * 8 + [1] * (len(r) - 8) for r in rows]
        return Dataset.from_dict({"input_ids": rows, "completion_mask": masks})
    if trainer == "reward":
        return Dataset.from_dict(
            {
                "chosen_ids": [ids(24, 48) for _ in range(n)],
                "rejected_ids": [ids(24, 48) for _ in range(n)],
            }
        )

    def words(low: int, high: int) -> str:  # DPO's rows are text, as TRL's examples write them
        return " ".join(f"t{i}" for i in ids(low, high))

    return Dataset.from_dict(
        {
            "prompt": [words(4, 8) for _ in range(n)],
            "chosen": [" " + words(20, 40) for _ in range(n)],
            "rejected": [" " + words(20, 40) for _ in range(n)],
        }
    )


def run_rank(row: str, opts: argparse.Namespace, out: Path) -> None:
    rank = harness.start_rank(row_timeout_s(opts.warmup + opts.steps))
    import torch
    import trl
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        TrainerCallback,
    )

    from lightning_zeropp.transformers import ZeroPPPlugin

    trainer_name, kind = row.rsplit("_", 1)
    total = opts.warmup + opts.steps
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **LLAMA, num_labels=1)
    auto = AutoModelForSequenceClassification if trainer_name == "reward" else AutoModelForCausalLM
    model = auto.from_config(config)
    pipeline = kind == "zeropp"
    # per device: DDP's 2 processes load 4 rows each; a pipeline of 2 loads BATCH x pp_size
    # rows once (its ranks share them): the same global batch
    common = {
        "output_dir": str(out / f"trl-{rank}"),
        "per_device_train_batch_size": BATCH,
        "max_steps": total,
        "learning_rate": 1e-4,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "bf16": False,
        "disable_tqdm": True,
    }
    if trainer_name == "sft":
        args: Any = trl.SFTConfig(**common, max_length=64, completion_only_loss=True)
    elif trainer_name == "reward":
        args = trl.RewardConfig(**common)
    else:
        args = trl.DPOConfig(**common, precompute_ref_log_probs=True)
    kwargs: dict[str, Any] = {}
    cls: Any = getattr(trl, TRAINERS[trainer_name])
    if pipeline:
        import lightning_zeropp.trl as zeropp_trl

        cls = getattr(zeropp_trl, f"ZeroPP{TRAINERS[trainer_name]}")
        kwargs["zeropp_plugin"] = ZeroPPPlugin(**PIPE)
    clock = harness.StepClock(opts.warmup, opts.steps)
    _ = args.device  # the Trainer's process group, set up by its arguments
    # on disk, written once: TRL's dataset processing and DPO's reference pass (TRL's own under
    # DDP: the main process computes, the others read its cache file) cache beside it, where
    # every process finds them (an in-memory dataset's cache is a temporary directory per process)
    from datasets import load_from_disk

    if rank == 0:
        _data(trainer_name, 2 * WORLD * BATCH * total).save_to_disk(str(out / "data"))
    torch.distributed.barrier()
    data = load_from_disk(str(out / "data"))

    class Steps(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            clock.start()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            clock.stop(0.0)

    trainer = cls(
        model=model,
        args=args,
        train_dataset=data,
        processing_class=_tokenizer(),
        callbacks=[Steps()],
        **kwargs,
    )
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    harness.finish_rank(
        out,
        rank,
        {"rank": rank, "steps": clock.records[opts.warmup :], **clock.result(), "losses": losses},
    )


def _tokenizer() -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, LLAMA["vocab_size"])}}
    words = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=words,
        pad_token="<pad>",
        eos_token="t1",
    )


def summarize(row: str, run: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    per_step = harness.slowest_per_step([x["total"] for x in r["steps"]] for r in ranks)
    return {
        "row": row,
        "run": run,
        "median_step_s": statistics.median(per_step),
        "fastest_step_s": min(per_step),
        "first_loss": ranks[0]["losses"][0],
        **harness.load_shares(ranks),
    }


def markdown(meta: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    rows = [r for r in ROWS if any(x["row"] == r for x in runs)]
    lines = [
        "# TRL's trainers: TRL's own under DDP vs ZeroPP's (CPU gloo)",
        "",
        *harness.machine_lines(meta["machine"], WORLD, ["transformers", "trl"]),
        f"- Model: `AutoConfig.for_model('llama', {LLAMA})`, fp32; per-device batch {BATCH} "
        f"(global {WORLD * BATCH}); AdamW; `python bench/bench_trl.py`",
        *harness.runs_lines(meta, WORLD, {r: ROWS[r] for r in rows}),
        "",
        "## Step time",
        "",
        "Per step the slowest rank's time (`on_step_begin` to `on_step_end`), median over the "
        "timed steps, median over runs; `/ DDP`: against the same trainer's `_ddp` row. On 2 "
        "shared cores a 2-stage pipeline has each stage idle while the other works (the "
        "pipeline's bubble) and gathers its shards each step; DDP runs the whole model on each "
        "core. First loss: the logged loss of step 1 (equal rows: the same numbers).",
        "",
    ]
    body = []
    for r in rows:
        base_row = r.rsplit("_", 1)[0] + "_ddp"
        step = harness.med(runs, r, "median_step_s")
        base = harness.med(runs, base_row, "median_step_s") if base_row in rows else float("nan")
        body.append(
            [f"`{r}`", f"{step:.3f}", f"{step / base:.2f}", f"{harness.med(runs, r, 'fastest_step_s'):.3f}"]
            + [f"{harness.med(runs, r, 'cpu_share'):.2f}", f"{harness.med(runs, r, 'others_share'):.2f}"]
            + [f"{harness.med(runs, r, 'first_loss'):.4f}"]
        )  # fmt: skip
    head = ["Row", "Median step (s)", "/ DDP", "Fastest (s)", "CPU share", "Others", "First loss"]
    return lines + harness.table(head, "l" + "r" * (len(head) - 1), body)


def main() -> None:
    parser = harness.arg_parser(__doc__, steps=8, warmup=2, repeats=1, rows=",".join(ROWS))
    args = parser.parse_args()
    if args.worker:
        run_rank(args.worker, args, Path(args.out))
        return
    harness.check_counts(parser, args)
    names = harness.pick_rows(parser, args.rows, ROWS)
    meta: dict[str, Any] = {"machine": harness.machine("transformers", "trl", library_only=True)}
    started = time.monotonic()

    def one_run(name: str, run: int) -> dict[str, Any]:
        total = args.warmup + args.steps
        ranks = harness.launch(
            __file__, name, WORLD, row_timeout_s(total), steps=args.steps, warmup=args.warmup
        )
        return summarize(name, run, ranks)

    runs = harness.run_rows(
        names, args.repeats, one_run, lambda r: f"median step {r['median_step_s']:.3f}s"
    )
    meta.update(steps=args.steps, warmup=args.warmup, repeats=args.repeats)
    meta["wall_s"] = time.monotonic() - started
    print(harness.write_results("trl", markdown(meta, runs), {**meta, "runs": runs}).read_text())


if __name__ == "__main__":
    main()
