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
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch_ranks, machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
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
    "pipeline": "  of which the pipeline's schedule (`core.train_step_deferred`)",
    "clip": "`_clip_grad_norm` (the global norm)",
    "optimizer": "`optimizer.step()`",
}


# ------------------------------------------------------------------------------ one rank
def run_rank(row: str, opts: argparse.Namespace, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from lightning_zeropp.transformers import ZeroPPPlugin, ZeroPPTrainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **LLAMA))
    g = torch.Generator().manual_seed(1)
    rows = 4 * WORLD * (opts.warmup + opts.steps)
    shortest = 8 if row in VARLEN else 48
    lengths = torch.randint(shortest, 65, (rows,), generator=g)
    data = [{"input_ids": torch.randint(1, 1024, (int(n),), generator=g).tolist()} for n in lengths]
    fsdp = {"fsdp": "full_shard", "fsdp_config": {"version": 2}} if row == "fsdp" else {}
    args = TrainingArguments(
        output_dir=str(out / f"trainer-{os.environ['RANK']}"),
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
    timer = Timer(opts.warmup)
    if row.startswith("zeropp"):
        schedule = "zeropp" if row == "zeropp_unit" else "1f1b"
        buckets = 16 if row == "zeropp_varlen_buckets" else None
        plugin = ZeroPPPlugin(**PIPE, schedule=schedule, seq_buckets=buckets)
        trainer: Any = ZeroPPTrainer(**kwargs, zeropp_plugin=plugin)
    else:
        trainer = Trainer(**kwargs)

    class Steps(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            dist.barrier()  # every rank starts the step together: the slowest rank sets it
            timer.start()

        def on_pre_optimizer_step(self, *a: Any, **k: Any) -> None:
            timer.begin("optimizer")

        def on_optimizer_step(self, *a: Any, **k: Any) -> None:
            timer.end("optimizer")

        def on_step_end(self, *a: Any, **k: Any) -> None:
            timer.stop()
            pipeline = getattr(trainer, "pipeline", None)
            if pipeline is not None and pipeline.engine.core.last_comms:
                timer.comms = pipeline.engine.core.last_comms

    trainer.add_callback(Steps())
    for name, attr in (("fetch", "get_batch_samples"), ("train_step", "training_step")):
        timer.wrap(trainer, attr, name)
    timer.wrap(trainer, "_clip_grad_norm", "clip")
    started = time.perf_counter()
    original = trainer.get_train_dataloader

    def loader_then_wrap() -> Any:  # the optimizer and pipeline exist once the loader does
        loader = original()
        if isinstance(trainer, ZeroPPTrainer):
            core = trainer.pipeline.engine.core
            core.count_comms = True
            timer.wrap(core, "train_step_deferred", "pipeline")
        return loader

    trainer.get_train_dataloader = loader_then_wrap
    output = trainer.train()
    setup_and_train = time.perf_counter() - started
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    result = {
        "steps": timer.steps,
        "phases": timer.phases,
        "comms": timer.comms,
        "losses": losses,
        "train_runtime": output.metrics["train_runtime"],
        "setup_and_train_s": setup_and_train,
        "planning": (
            trainer.pipeline.engine.core.planning.summary()
            if isinstance(trainer, ZeroPPTrainer)
            else None
        ),
    }
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))


def _tokenizer() -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, 1024)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>"
    )


class Timer:
    """Step times and wrapped-call times, per step after the warm-up steps."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.step = warmup, 0
        self.steps: list[float] = []
        self.phases: dict[str, list[float]] = {}
        self.current: dict[str, float] = {}
        self.comms: Any = None
        self._t0 = self._open = 0.0

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        inner = getattr(obj, attr)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - t

        setattr(obj, attr, timed)

    def start(self) -> None:
        self.current = {k: v for k, v in self.current.items() if k == "fetch"}
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        elapsed = time.perf_counter() - self._t0
        self.step += 1
        if self.step > self.warmup:
            self.steps.append(elapsed)
            for k, v in self.current.items():
                self.phases.setdefault(k, []).append(v)
        self.current = {}

    def begin(self, name: str) -> None:
        self._open = time.perf_counter()

    def end(self, name: str) -> None:
        self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - self._open


# ------------------------------------------------------------------------------ the driver
def summarize(row: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [max(r["steps"][i] for r in ranks) for i in range(len(ranks[0]["steps"]))]
    phases = {
        name: statistics.mean(statistics.median(r["phases"][name]) for r in ranks)
        for name in PHASES
        if all(name in r["phases"] for r in ranks)
    }
    comms = None
    if ranks[0]["comms"]:
        comms = {
            kind: {
                axis: {
                    "count": statistics.mean(r["comms"][kind][axis]["count"] for r in ranks if kind in r["comms"] and axis in r["comms"][kind]),
                    "MiB": statistics.mean(r["comms"][kind][axis]["bytes"] for r in ranks if kind in r["comms"] and axis in r["comms"][kind]) / 2**20,
                }
                for axis in ranks[0]["comms"][kind]
            }
            for kind in ranks[0]["comms"]
        }  # fmt: skip
    return {
        "row": row,
        "median_step_s": statistics.median(steps),
        "fastest_step_s": min(steps),
        "phases_ms": {k: 1e3 * v for k, v in phases.items()},
        "comms": comms,
        "final_loss": ranks[0]["losses"][-1],
        "setup_and_train_s": max(r["setup_and_train_s"] for r in ranks),
        "planning": ranks[0]["planning"],
    }


def write_markdown(meta: dict[str, Any], runs: list[dict[str, Any]], path: Path) -> None:
    rows = [r for r in ROWS if any(x["row"] == r for x in runs)]

    def med(row: str, key: str, sub: str | None = None) -> float:
        values = [
            x[key] if sub is None else x[key].get(sub, float("nan"))
            for x in runs
            if x["row"] == row
        ]
        return statistics.median(values)  # fmt: skip

    m = meta["machine"]
    lines = [
        "# A transformers.Trainer script: plain Trainer (DDP, FSDP2) vs ZeroPPTrainer (CPU gloo)",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, shared with other work (1-minute load "
        f"average {m['load_average_1m_at_start']:.1f} at the start: figures move with the "
        "load); 4 gloo ranks, one thread each",
        f"- Date: {m['date']}; torch {m['torch']}, transformers {meta['transformers']}, "
        f"Python {m['python']}; commit {m['commit']}",
        f"- Model: `AutoConfig.for_model('llama', {LLAMA})`, fp32; rows of 48-64 tokens padded "
        "to 64 by `DataCollatorForLanguageModeling`; per-device batch 4 (global 16); AdamW, "
        "cosine schedule, clipping at 1.0",
        f"- {meta['warmup']} warm-up steps, then {meta['steps']} timed steps; {meta['repeats']} "
        f"runs per row in fresh processes, rows alternating; script {meta['seconds']:.0f} s; "
        "`python bench/bench_trainer.py`",
        "",
        "| Row | Layout |",
        "|---|---|",
        *[f"| `{r}` | {ROWS[r]} |" for r in rows],
        "",
        "## Step time (median over runs)",
        "",
        "Step: the slowest rank's time from the step's start (all ranks after a barrier) to the "
        "Trainer's `on_step_end`, median over the timed steps; `/ DDP`: against `ddp` (the "
        "`_varlen` rows against `ddp_varlen`). Schedules and planning: what re-planning for new "
        "batch shapes cost the whole run, warm-up included (`train_schedules_built`, "
        "`train_planning_seconds`: building each schedule and its shape-inference pass).",
        "",
        "| Row | Median step (s) | / DDP | Fastest step (s) | Final loss | Schedules built "
        "| Evicted | Planning (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        step = med(r, "median_step_s")
        ref = "ddp_varlen" if r in VARLEN else "ddp"
        base = med(ref, "median_step_s") if ref in rows else float("nan")
        plan = next((x["planning"] for x in runs if x["row"] == r and x["planning"]), None)
        planned = (
            f"{plan['schedules_built']:.0f} | {plan['schedule_evictions']:.0f} | "
            f"{plan['planning_seconds']:.2f}"
            if plan
            else "- | - | -"
        )
        lines.append(
            f"| `{r}` | {step:.3f} | {step / base:.2f} | {med(r, 'fastest_step_s'):.3f} | "
            f"{med(r, 'final_loss'):.4f} | {planned} |"
        )
    others = [r for r in rows if r not in ("ddp", "ddp_varlen")]
    lines += [
        "",
        "## Where the time goes (ms per step)",
        "",
        "Per rank the median over the timed steps of each wrapped call, then the mean over the "
        "ranks, median over runs; `rest`: the step minus the top-level calls (the Trainer's "
        "bookkeeping, logging, the scheduler, callbacks). The ZeroPP rows' `training_step` is "
        "the whole pipeline step (forward and backward of every micro-batch, the FSDP gathers "
        "and reduce-scatters, the stage-to-stage sends).",
        "",
        "| Call | "
        + " | ".join([f"`{r}`" for r in rows] + [f"`{r}` - `{_ddp_of(r)}`" for r in others])
        + " |",
        "|---|" + "---:|" * (len(rows) + len(others)),
    ]
    table = {name: {r: med(r, "phases_ms", name) for r in rows} for name in PHASES}
    table["rest"] = {}
    for r in rows:
        calls = [k for k in ("fetch", "train_step", "clip", "optimizer") if k in _keys(runs, r)]
        table["rest"][r] = 1e3 * med(r, "median_step_s") - sum(table[k][r] for k in calls)
    for name, cells in table.items():
        diffs = [cells[r] - cells.get(_ddp_of(r), float("nan")) for r in others]
        values = [_ms(cells[r]) for r in rows] + [_ms(d, signed=True) for d in diffs]
        lines.append(f"| {PHASES.get(name, 'rest')} | " + " | ".join(values) + " |")
    lines += _comm_table(runs, rows)
    path.write_text("\n".join(lines) + "\n")


def _ddp_of(row: str) -> str:
    return "ddp_varlen" if row in VARLEN else "ddp"


def _keys(runs: list[dict[str, Any]], row: str) -> set[str]:
    return {k for x in runs if x["row"] == row for k in x["phases_ms"]}


def _ms(value: float, signed: bool = False) -> str:
    if value != value:  # NaN: not measured in that row
        return "-"
    return f"{value:+.1f}" if signed else f"{value:.1f}"


def _comm_table(runs: list[dict[str, Any]], rows: list[str]) -> list[str]:
    lines = ["", "## Collectives of one pipeline step (ZeroPP rows; mean over ranks)", ""]
    lines += ["| Row | kind | axis | calls | MiB |", "|---|---|---|---:|---:|"]
    for r in rows:
        comms = next((x["comms"] for x in runs if x["row"] == r and x["comms"]), None)
        for kind, axes in (comms or {}).items():
            for axis, v in axes.items():
                lines.append(f"| `{r}` | {kind} | {axis} | {v['count']:.0f} | {v['MiB']:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--worker")
    parser.add_argument("--out")
    opts = parser.parse_args()
    if opts.worker:
        run_rank(opts.worker, opts, Path(opts.out))
        return
    import transformers

    started = time.perf_counter()
    meta = {"machine": machine(), "transformers": transformers.__version__}
    rows = opts.rows.split(",")
    runs = []
    for repeat in range(opts.repeats):
        for row in rows if repeat % 2 == 0 else rows[::-1]:
            args = ["--steps", str(opts.steps), "--warmup", str(opts.warmup)]
            ranks = launch_ranks(__file__, row, WORLD, args, timeout_s=900)
            runs.append(summarize(row, ranks))
            print(f"{row}: median step {runs[-1]['median_step_s']:.3f} s", flush=True)
    meta.update(steps=opts.steps, warmup=opts.warmup, repeats=opts.repeats)
    meta["seconds"] = time.perf_counter() - started
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "trainer.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    write_markdown(meta, runs, RESULTS / "trainer.md")
    print((RESULTS / "trainer.md").read_text())


if __name__ == "__main__":
    main()
