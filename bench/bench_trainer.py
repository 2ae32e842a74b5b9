"""A `transformers.Trainer` script under the plain Trainer (DDP, FSDP2) and under `ZeroPPTrainer`.

    python bench/bench_trainer.py [--steps 10] [--warmup 3] [--repeats 2] [--rows ddp,fsdp,...]

The same tiny HF Llama (`AutoConfig.for_model("llama", ...)`, 3.9 M parameters, as in
bench_accelerate.py), the same data (rows of 48-64 tokens, `DataCollatorForLanguageModeling`
padding them to 64 with -100 labels on the padding), per-device batch 4 on 4 gloo CPU ranks (one
thread each): a global batch of 16 rows, AdamW, cosine schedule, clipping at 1.0, fp32. Rows:

- `ddp`: `Trainer(...)`, which wraps the model in DDP over the 4 processes;
- `fsdp`: `Trainer(...)` with `TrainingArguments(fsdp="full_shard", fsdp_config={"version": 2})`
  (FSDP2 over the 4 processes, through Accelerate's plugin);
- `zeropp_1f1b`: `ZeroPPTrainer(..., zeropp_plugin=ZeroPPPlugin(pp_size=2, num_microbatches=4))`
  (pp 2 x dp_shard 2, 1F1B over FSDP2);
- `zeropp_unit`: the same with `schedule="zeropp"` (v = 2, U = pp);
- lengths that change every step (rows of 8-64 tokens, each batch padded to its longest row):
  `ddp_varlen`, `zeropp_varlen` (1F1B, a schedule per length seen) and `zeropp_varlen_buckets`
  (`seq_buckets=16`: lengths padded to multiples of 16, at most 4 shapes).

Per rank and step (a callback's `on_step_begin` to `on_step_end`, after a barrier): the step,
split by wrappers this script sets on the Trainer (`get_batch_samples`: fetching the batches
and counting their tokens; `training_step`: forward and backward; `_clip_grad_norm`; the
optimizer's `step`) and, in the ZeroPP rows, on the pipeline (`core.train_step_deferred`: the
schedule itself), plus the collectives of one pipeline step (`count_comms`) and what
re-planning for new shapes cost the run (`core.planning`). Every row runs `--repeats` times in
4 fresh processes, rows alternating their order. Results: bench/results/trainer.md and .json (`BENCH_RESULTS=dir`
writes them elsewhere). The figures of a shared machine move with its load: the header gives
the load average.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

WORLD = 4
LLAMA = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "use_cache": False,
}
PIPE = {"pp_size": 2, "num_microbatches": 4}
ROWS = {
    "ddp": "Trainer: DDP over 4 processes",
    "fsdp": "Trainer: FSDP2 over 4 processes (fsdp='full_shard', version 2)",
    "zeropp_1f1b": "ZeroPPTrainer: pp 2 x dp_shard 2, 1F1B over FSDP2, 4 micro-batches",
    "zeropp_unit": "ZeroPPTrainer: pp 2 x dp_shard 2, schedule='zeropp' (v 2, U 2), 4 micro-batches",
    # changing lengths: rows of 8-64 tokens, each batch padded to its longest row
    "ddp_varlen": "Trainer: DDP, rows of 8-64 tokens padded to each batch's longest",
    "zeropp_varlen": "ZeroPPTrainer (1F1B), rows of 8-64 tokens: a schedule per length seen",
    "zeropp_varlen_buckets": "ZeroPPTrainer (1F1B), rows of 8-64 tokens, seq_buckets=16",
}
VARLEN = {"ddp_varlen", "zeropp_varlen", "zeropp_varlen_buckets"}
PHASES = {  # name -> what it times
    "fetch": "`get_batch_samples` (the batch, and its token count gathered)",
    "train_step": "`training_step` (forward and backward)",
    "pipeline": "&nbsp;&nbsp;of which the pipeline's schedule (`core.train_step_deferred`)",
    "clip": "`_clip_grad_norm` (the global norm)",
    "optimizer": "`optimizer.step()`",
}


# ------------------------------------------------------------------------------ one rank
def row_timeout_s(steps: int) -> float:
    """Start-up plus a generous 20 s a step (under 2 s on 2 quiet cores)."""
    return harness.row_timeout_s(steps, start_s=300.0, per_step_s=20.0)


def run_rank(row: str, opts: argparse.Namespace, out: Path) -> None:
    """One rank of one row: the Trainer's warm-up + timed steps; write this rank's JSON."""
    rank = harness.start_rank(row_timeout_s(opts.warmup + opts.steps))
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from lightning_zeropp.transformers import ZeroPPPlugin, ZeroPPTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **LLAMA))
    g = torch.Generator().manual_seed(1)
    rows = 4 * WORLD * (opts.warmup + opts.steps)
    shortest = 8 if row in VARLEN else 48
    lengths = torch.randint(shortest, 65, (rows,), generator=g)
    data = [{"input_ids": torch.randint(1, 1024, (int(n),), generator=g).tolist()} for n in lengths]
    fsdp = {"fsdp": "full_shard", "fsdp_config": {"version": 2}} if row == "fsdp" else {}
    args = TrainingArguments(
        output_dir=str(out / f"trainer-{rank}"),
        per_device_train_batch_size=4,
        max_steps=opts.warmup + opts.steps,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        **fsdp,
    )
    pad = None if row in VARLEN else 64  # changing lengths: padded to the longest row only
    collator = DataCollatorForLanguageModeling(_tokenizer(), mlm=False, pad_to_multiple_of=pad)
    kwargs = {"model": model, "args": args, "train_dataset": data, "data_collator": collator}
    if row.startswith("zeropp"):
        schedule = "zeropp" if row == "zeropp_unit" else "1f1b"
        buckets = 16 if row == "zeropp_varlen_buckets" else None
        plugin = ZeroPPPlugin(**PIPE, schedule=schedule, seq_buckets=buckets)
        trainer: Any = ZeroPPTrainer(**kwargs, zeropp_plugin=plugin)
    else:
        trainer = Trainer(**kwargs)
    clock = harness.StepClock(opts.warmup, opts.steps, inner=list(PHASES))
    # A step starts when the Trainer fetches its batch (before its on_step_begin) and ends at
    # its on_step_end; the calls in between are timed by wrappers on this trainer.
    clock.wrap(trainer, "get_batch_samples", "fetch")
    fetch = trainer.get_batch_samples

    def started(*a: Any, **k: Any) -> Any:
        clock.start()  # every rank behind a barrier
        return fetch(*a, **k)

    trainer.get_batch_samples = started
    clock.wrap(trainer, "_clip_grad_norm", "clip")
    last = {"loss": 0.0}
    step_call = trainer.training_step

    def training_step(*a: Any, **k: Any) -> Any:
        loss = step_call(*a, **k)
        last["loss"] = loss
        return loss

    trainer.training_step = training_step
    clock.wrap(trainer, "training_step", "train_step")
    comms: list[Any] = []  # each timed step's collectives (pipeline rows)

    class Steps(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:  # the optimizer exists
            clock.wrap(trainer.optimizer, "step", "optimizer")
            pipeline = getattr(trainer, "pipeline", None)
            if pipeline is not None:
                pipeline.engine.core.count_comms = True
                clock.wrap(pipeline.engine.core, "train_step_deferred", "pipeline")

        def on_step_end(self, *a: Any, **k: Any) -> None:
            timed = clock.timed
            clock.stop(last["loss"])
            pipeline = getattr(trainer, "pipeline", None)
            if timed and pipeline is not None and pipeline.engine.core.last_comms:
                comms.append(pipeline.engine.core.last_comms)

    trainer.add_callback(Steps())
    trainer.train()
    pipeline = getattr(trainer, "pipeline", None)
    result = {
        "rank": rank,
        "steps": clock.records[opts.warmup :],
        **clock.result(),
        "comms": comms,
        # the Trainer's logged loss (the mean over processes: under DDP each process's
        # training_step returns its own share of the loss, scaled by the process count)
        "logged_losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
        "planning": pipeline.engine.core.planning.summary() if pipeline is not None else None,
    }
    harness.finish_rank(out, rank, result)


def _tokenizer() -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, 1024)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>"
    )


# ------------------------------------------------------------------------------ the driver
def summarize(row: str, run: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One run of one row: the slowest rank per step, each call's time, the collectives."""
    per_step = harness.slowest_per_step([x["total"] for x in r["steps"]] for r in ranks)
    calls = {
        name: statistics.mean(statistics.median(x[name] for x in r["steps"]) for r in ranks)
        for name in PHASES
    }
    if not row.startswith("zeropp"):
        calls["pipeline"] = float("nan")  # no pipeline in that row
    comms = _median_comms(ranks) if ranks[0]["comms"] else None
    return {
        "row": row,
        "run": run,
        "median_step_s": statistics.median(per_step),
        "fastest_step_s": min(per_step),
        "calls_ms": {k: 1e3 * v for k, v in calls.items()},
        "comms": comms,
        "final_loss": ranks[0]["logged_losses"][-1],
        "planning": ranks[0]["planning"],
        **harness.load_shares(ranks),
    }


def _median_comms(ranks: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per kind and axis, the median over the timed steps of a step's calls and MiB, mean over
    ranks (steps differ where a new batch shape re-plans: its shape inference gathers too)."""
    keys = {(k, a) for r in ranks for step in r["comms"] for k, axes in step.items() for a in axes}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for kind, axis in sorted(keys):
        for field, unit in (("count", 1), ("bytes", harness.MIB)):
            value = statistics.mean(
                statistics.median(s.get(kind, {}).get(axis, {}).get(field, 0) for s in r["comms"])
                / unit
                for r in ranks
            )
            name = "count" if field == "count" else "MiB"
            out.setdefault(kind, {}).setdefault(axis, {})[name] = value
    return out


def markdown(meta: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    rows = [r for r in ROWS if any(x["row"] == r for x in runs)]
    med = functools.partial(harness.med, runs)
    lines = [
        "# A transformers.Trainer script: plain Trainer (DDP, FSDP2) vs ZeroPPTrainer (CPU gloo)",
        "",
        *harness.machine_lines(meta["machine"], WORLD, ["transformers"]),
        f"- Model: `AutoConfig.for_model('llama', {LLAMA})`, fp32; per-device batch 4 (global "
        "16); AdamW, cosine schedule, clipping at 1.0; rows of 48-64 tokens padded to 64 by "
        "`DataCollatorForLanguageModeling` (the `_varlen` rows: 8-64 tokens, each batch padded "
        "to its longest row); `python bench/bench_trainer.py`",
        *harness.runs_lines(meta, WORLD, {r: ROWS[r] for r in rows}),
        "",
        "## Step time (median over runs)",
        "",
        "Step: per step the slowest rank's time, from the Trainer fetching the step's batch (all "
        "ranks after a barrier) to its `on_step_end`, median over the timed steps; `/ DDP`: "
        "against `ddp` (the `_varlen` rows against `ddp_varlen`). CPU share: the ranks' CPU "
        "time per core-second over the timed steps (near 1: the cores were theirs); others: "
        "other processes' share. Schedules and planning: what re-planning for new batch shapes "
        "cost the whole run, warm-up included (`train_schedules_built`, "
        "`train_schedule_evictions`, `train_planning_seconds`: building each schedule and its "
        "shape-inference pass).",
        "",
    ]
    body = []
    for r in rows:
        base = med(_ddp_of(r), "median_step_s") if _ddp_of(r) in rows else float("nan")
        plan = next((x["planning"] for x in runs if x["row"] == r and x["planning"]), None)
        planned = ["-", "-", "-"]
        if plan:
            planned = [
                f"{plan['schedules_built']:.0f}",
                f"{plan['schedule_evictions']:.0f}",
                f"{plan['planning_seconds']:.2f}",
            ]
        step = med(r, "median_step_s")
        body.append(
            [f"`{r}`", f"{step:.3f}", f"{step / base:.2f}", f"{med(r, 'fastest_step_s'):.3f}"]
            + [f"{med(r, 'cpu_share'):.2f}", f"{med(r, 'others_share'):.2f}"]
            + [f"{med(r, 'final_loss'):.4f}", *planned]
        )
    head = ["Row", "Median step (s)", "/ DDP", "Fastest (s)", "CPU share", "Others"]
    head += ["Final loss", "Schedules built", "Evicted", "Planning (s)"]
    lines += harness.table(head, "l" + "r" * (len(head) - 1), body)
    others = [r for r in rows if r not in ("ddp", "ddp_varlen")]
    lines += [
        "",
        "## Where the time goes (ms per step)",
        "",
        "Per rank the median over the timed steps of each call, then the mean over the ranks, "
        "median over runs; `rest`: the step minus the top-level calls (the Trainer's "
        "bookkeeping, logging, the scheduler, callbacks). The ZeroPP rows' `training_step` is "
        "the whole pipeline step (forward and backward of every micro-batch, the FSDP gathers "
        "and reduce-scatters, the stage-to-stage sends); the `- ddp` columns say where the "
        "difference in step time goes.",
        "",
    ]
    table = {n: {r: statistics.median(_call(runs, r, n)) for r in rows} for n in PHASES}
    table["rest"] = {
        r: 1e3 * med(r, "median_step_s") - sum(table[n][r] for n in TOP_LEVEL) for r in rows
    }
    body = []
    for name, cells in table.items():
        diffs = [cells[r] - cells.get(_ddp_of(r), float("nan")) for r in others]
        body.append(
            [PHASES.get(name, "rest")]
            + [_ms(cells[r]) for r in rows]
            + [_ms(d, signed=True) for d in diffs]
        )
    head = ["Call", *[f"`{r}`" for r in rows], *[f"`{r}` - `{_ddp_of(r)}`" for r in others]]
    lines += harness.table(head, "l" + "r" * (len(head) - 1), body)
    return lines + _comm_table(runs, rows)


TOP_LEVEL = ("fetch", "train_step", "clip", "optimizer")


def _call(runs: list[dict[str, Any]], row: str, name: str) -> list[float]:
    return [x["calls_ms"][name] for x in runs if x["row"] == row]


def _ddp_of(row: str) -> str:
    return "ddp_varlen" if row in VARLEN else "ddp"


def _ms(value: float, signed: bool = False) -> str:
    if value != value:  # NaN
        return "-"
    return f"{value:+.1f}" if signed else f"{value:.1f}"


def _comm_table(runs: list[dict[str, Any]], rows: list[str]) -> list[str]:
    lines = [
        "",
        "## Collectives of one pipeline step (ZeroPP rows)",
        "",
        "Per kind and mesh axis: the median over the timed steps, mean over the ranks.",
        "",
    ]
    body = []
    for r in rows:
        comms = next((x["comms"] for x in runs if x["row"] == r and x["comms"]), None)
        for kind, axes in (comms or {}).items():
            for axis, v in axes.items():
                body.append([f"`{r}`", kind, axis, f"{v['count']:.0f}", f"{v['MiB']:.2f}"])
    return lines + harness.table(["Row", "Kind", "Axis", "Calls", "MiB"], "lllrr", body)


def main() -> None:
    parser = harness.arg_parser(__doc__, steps=10, warmup=3, repeats=2, rows=",".join(ROWS))
    args = parser.parse_args()
    if args.worker:
        run_rank(args.worker, args, Path(args.out))
        return
    harness.check_counts(parser, args)
    names = harness.pick_rows(parser, args.rows, ROWS)
    meta: dict[str, Any] = {"machine": harness.machine("transformers", library_only=True)}
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
    print(
        harness.write_results("trainer", markdown(meta, runs), {**meta, "runs": runs}).read_text()
    )


if __name__ == "__main__":
    main()
