"""A 1B-class Llama in bf16 on one GPU: plain Lightning against ZeroPPStrategy, eager and compiled.

    python bench/gpu/bench_1b.py [--rows ...] [--steps 10] [--warmup 4] [--budget-s 330]
    python bench/gpu/bench_1b.py --device cpu --tiny      # a dry run of every row on the CPU

Model: conf/model/llama_1b.yaml's shape (TinyLlama-1.1B: 22 x 2048, 32 heads, 4 KV heads, vocab
32000), random weights, sequences of 2048 random tokens, 4 rows a step, AdamW, `LitCausalLM`.
Rows, each in its own fresh process (its own CUDA context and compile caches in memory):

- `lightning_eager` / `lightning_compiled`: `pl.Trainer(precision="bf16-mixed")` on the module as
  written; compiled = each decoder layer compiled in place, as torchtitan does (`layer.compile()`).
- `zeropp_eager` / `zeropp_compiled`: `ZeroPPStrategy(param_dtype="bf16")` on one rank (FSDP2 over
  one rank, one stage, 4 micro-batches of 1 row); compiled = `compile=True` (whole blocks).
  `..._mb1`: the same with one micro-batch of all 4 rows (the default at pp_size 1): the pair
  prices micro-batching itself, which on one rank only costs (1-row micro-batches of 2048 tokens
  leave an H200 launch-bound: see gpu_blocks.md's 2048- against 8192-token rows).
- `zeropp_split_eager` / `zeropp_split_compiled`: `schedule="zeropp"` with two chunks on the one
  rank and its split backward; compiled = the regions between the weights.

Per row: median step time over the timed steps (CUDA-synchronized at each batch's start and end),
tokens/s, MFU (torchtitan's count: 6 x (parameters - input embedding) + 12 x layers x hidden x
sequence FLOPs per token, over 989 TFLOP/s bf16 dense for H100/H200), the first step's time
(compiling), peak memory, first and last loss, and for ZeroPP rows how often compiled code ran.
`--profile` writes torch.profiler tables of two steps per row (gpu_1b_profile_<row>.txt; the
row's median then includes those slower steps). Rows run until `--budget-s` is spent (a row
that would not fit is reported as skipped). Writes
bench/results/gpu_1b.json and gpu_1b.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
ROWS = (
    "lightning_eager",
    "zeropp_eager_mb1",
    "zeropp_eager",
    "lightning_compiled",
    "zeropp_compiled_mb1",
    "zeropp_compiled",
    "zeropp_split_eager",
    "zeropp_split_compiled",
)
SHAPES = {
    "1b": {
        "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
        "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "seq": 2048, "rows": 4,
    },
    "tiny": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "seq": 32, "rows": 4,
    },
}  # fmt: skip
MICROBATCHES = 4
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}  # dense bf16 TFLOP/s, SXM parts


# ---------------------------------------------------------------------------------------- row
def run_row(
    row: str, device: str, shape_name: str, steps: int, warmup: int, out: Path, profile: bool
) -> None:
    import lightning.pytorch as pl
    import torch

    from lightning_zeropp.models.hf import build_causal_lm
    from lightning_zeropp.models.lit_causal_lm import LitCausalLM

    shape = dict(SHAPES[shape_name])
    seq, rows = shape.pop("seq"), shape.pop("rows")
    torch.manual_seed(0)
    on = torch.device("cuda" if device == "cuda" else "cpu")
    with on:  # random init where it runs: a 1B model initializes in seconds on a GPU
        net = build_causal_lm("llama", seed=0, **shape)
    zeropp = row.startswith("zeropp")
    compiled = "compiled" in row
    # `<row>_mb1`: one micro-batch of all the step's rows (what micro-batching itself costs)
    microbatches = 1 if row.endswith("_mb1") else MICROBATCHES
    if compiled and not zeropp:
        for layer in net.model.layers:
            layer.compile()  # torchtitan's per-block compile, as a plain-Lightning user would
    micro = rows // microbatches if zeropp else rows
    module = LitCausalLM(net, micro_batch_size=micro, seq_len=seq, loss="logits")
    timer = _step_timer(on, profile_at=warmup if profile else None)
    kwargs: dict[str, Any] = {"precision": "bf16-mixed"}
    if zeropp:
        from lightning_zeropp import ZeroPPStrategy

        layout: dict[str, Any] = {"pp_size": 1, "num_microbatches": microbatches}
        if "split" in row:
            layout.update(schedule="zeropp", num_chunks=2, reshard_after_forward=False)
        kwargs = {
            "precision": "32-true",
            "strategy": ZeroPPStrategy(
                param_dtype="bf16", compile=compiled, split="call", **layout
            ),
        }
    trainer = pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        **kwargs,
    )
    data = _random_tokens((warmup + steps) * rows, seq, shape["vocab_size"])
    loader = torch.utils.data.DataLoader(data, batch_size=rows)
    trainer.fit(module, loader)
    params = sum(p.numel() for p in net.parameters())  # the unsplit model's count
    embedding = net.model.embed_tokens.weight.numel()
    layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
    result = {
        "row": row,
        "step_times_s": timer.times,
        "losses": timer.losses,
        "tokens_per_step": rows * seq,
        "flops_per_token": 6 * (params - embedding) + 12 * layers * hidden * seq,
        "params": params,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "compile": _compile_stats() if zeropp else None,
    }
    out.write_text(json.dumps(result))
    if timer.profile is not None:
        _write_profile(row, timer, RESULTS / f"gpu_1b_profile_{row}.txt")


PROFILED_STEPS = 2


def _step_timer(device: Any, profile_at: int | None = None) -> Any:
    """A Lightning callback keeping each training batch's wall time (device-synchronized) and
    loss in `.times` and `.losses`; with `profile_at`, torch.profiler records batches
    `profile_at` .. `profile_at + PROFILED_STEPS - 1` into `.profile`."""
    import lightning.pytorch as pl
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self._start = 0.0
            self.profile: Any = None
            self.profiled_s = 0.0

        def on_train_batch_start(self, *args: Any) -> None:
            sync()
            if profile_at is not None and len(self.times) == profile_at:
                from torch.profiler import ProfilerActivity, profile

                kinds = [ProfilerActivity.CPU] + (
                    [ProfilerActivity.CUDA] if device.type == "cuda" else []
                )
                self.profile = profile(activities=kinds)
                self.profile.__enter__()
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
            sync()
            self.times.append(time.perf_counter() - self._start)
            if (
                profile_at is not None
                and profile_at <= len(self.times) - 1 < profile_at + PROFILED_STEPS
            ):
                self.profiled_s += self.times[-1]
                if len(self.times) == profile_at + PROFILED_STEPS:
                    self.profile.__exit__(None, None, None)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.losses.append(float(loss))

    return StepTimer()


def _write_profile(row: str, timer: Any, path: Path) -> None:
    """The profiled steps' busiest operators (device and host time), the device's busy share of
    the wall time, and the host synchronizations: where a row's step time goes."""
    events = timer.profile.key_averages()
    device_us = sum(e.self_device_time_total for e in events)
    syncs = {
        e.key: e.count
        for e in events
        if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense",
                     "cudaMemcpyAsync", "cudaEventSynchronize", "cudaLaunchKernel")
    }  # fmt: skip
    head = [
        f"# {row}: {PROFILED_STEPS} profiled steps, {timer.profiled_s:.4f} s wall",
        f"device kernel time {device_us / 1e6:.4f} s = "
        f"{device_us / 1e6 / max(timer.profiled_s, 1e-9):.1%} of the wall time",
        f"host calls: {json.dumps(syncs)}",
        "",
    ]
    by_device = events.table(
        sort_by="self_device_time_total", row_limit=30, max_name_column_width=70
    )
    by_host = events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    path.write_text("\n".join(head) + by_device + "\n\n" + by_host + "\n")


def _random_tokens(n: int, seq: int, vocab: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _compile_stats() -> dict[str, int]:
    from lightning_zeropp.core.shard.compile import compile_stats

    return compile_stats()


# ---------------------------------------------------------------------------------------- driver
def summarize(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    times = result["step_times_s"]
    timed = times[warmup:] or times
    median = statistics.median(timed)
    tokens_s = result["tokens_per_step"] / median
    peak = next((v for k, v in PEAK_BF16.items() if k in result["device"]), None)
    compile_runs = None
    if result["compile"]:
        stats = result["compile"]
        compile_runs = stats.get("whole_runs", 0) + stats.get("split_runs", 0)
    return {
        "row": result["row"],
        "device": result["device"],
        "median_step_s": median,
        "first_step_s": times[0],
        "tokens_per_s": tokens_s,
        "mfu": tokens_s * result["flops_per_token"] / peak if peak else None,
        "peak_memory_gib": (result["peak_memory_bytes"] or 0) / 2**30,
        "first_loss": result["losses"][0],
        "last_loss": result["losses"][-1],
        "compiled_runs": compile_runs,
        "fallbacks": (result["compile"] or {}).get("fallbacks", 0),
    }


def write_markdown(meta: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    out = [
        "## 1B-class Llama, bf16, one GPU: plain Lightning against ZeroPPStrategy",
        "",
        f"Machine: {json.dumps(meta.get('machine', {}))}",
        "",
        f"{meta['shape']} shape, {meta['tokens_per_step']} tokens a step "
        f"({meta['params'] / 1e9:.2f} B parameters), {meta['steps']} timed steps after "
        f"{meta['warmup']} warm-up; MFU over 989 TFLOP/s (torchtitan's FLOP count). "
        "`python bench/gpu/bench_1b.py`.",
        "",
        "| row | median step (s) | tokens/s | MFU | first step (s) | peak GiB | loss first -> last "
        "| compiled runs | fallbacks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r or "error" in r:
            out.append(f"| {r['row']} | {r.get('skipped') or r.get('error')} |||||||| ")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        runs = "" if r["compiled_runs"] is None else str(r["compiled_runs"])
        out.append(
            f"| {r['row']} | {r['median_step_s']:.4f} | {r['tokens_per_s']:.0f} | {mfu} | "
            f"{r['first_step_s']:.1f} | {r['peak_memory_gib']:.1f} | "
            f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} | {runs} | {r['fallbacks']} |"
        )
    by = {r["row"]: r for r in rows if "median_step_s" in r}
    pairs = [
        ("zeropp_eager_mb1", "lightning_eager"),
        ("zeropp_compiled_mb1", "lightning_compiled"),
        ("zeropp_eager", "zeropp_eager_mb1"),
        ("zeropp_eager", "lightning_eager"),
        ("zeropp_compiled", "lightning_compiled"),
        ("lightning_compiled", "lightning_eager"),
        ("zeropp_compiled", "zeropp_eager"),
        ("zeropp_split_compiled", "zeropp_split_eager"),
        ("zeropp_split_compiled", "zeropp_compiled"),
    ]
    out += ["", "Step-time ratios:", ""]
    for a, b in pairs:
        if a in by and b in by:
            ratio = by[a]["median_step_s"] / by[b]["median_step_s"]
            out.append(f"- {a} / {b}: {ratio:.3f}")
    path.write_text("\n".join(out) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a tiny model (dry runs)")
    parser.add_argument("--budget-s", type=float, default=330.0)
    parser.add_argument("--row-timeout-s", type=float, default=150.0)
    parser.add_argument("--profile", action="store_true", help="torch.profiler tables per row")
    parser.add_argument("--row")  # internal: run one row in this process
    parser.add_argument("--out")
    args = parser.parse_args()
    shape = "tiny" if args.tiny else "1b"
    if args.row:
        run_row(args.row, args.device, shape, args.steps, args.warmup, Path(args.out), args.profile)
        return
    caches = tempfile.mkdtemp(prefix="gpu_1b_inductor_")

    def cache(row: str) -> str:
        return str(Path(caches) / row)

    deadline = time.monotonic() + args.budget_s
    sys.path.insert(0, str(ROOT))  # run as a script: bench/ is a package of the repository
    from bench.common import machine

    rows: list[dict[str, Any]] = []
    meta = {"shape": shape, "steps": args.steps, "warmup": args.warmup, "machine": machine()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    for row in args.rows.split(","):
        left = deadline - time.monotonic()
        if left < 30:
            rows.append(
                {"row": row, "skipped": f"skipped: the {args.budget_s:.0f} s budget ran out"}
            )
            continue
        out = RESULTS / f".gpu_1b_{row}.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--row", row, "--out", str(out), "--device", args.device]
        cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        cmd += (["--tiny"] if args.tiny else []) + (["--profile"] if args.profile else [])
        t0 = time.monotonic()
        try:
            done = subprocess.run(
                cmd, cwd=ROOT, capture_output=True, text=True,
                timeout=min(args.row_timeout_s, left),
                # a cache of its own: a row stopped while compiling can leave a truncated kernel,
                # which a later row sharing the cache would load and fail on
                env={**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": cache(row)},
            )  # fmt: skip
            failure = None if done.returncode == 0 and out.exists() else done.stderr
        except subprocess.TimeoutExpired:
            failure = f"timed out after {min(args.row_timeout_s, left):.0f} s"
        if failure is not None:
            rows.append({"row": row, "error": f"failed: {_error_line(str(failure))[:200]}"})
            print(f"{row}: FAILED ({time.monotonic() - t0:.0f} s)\n{str(failure)[-3000:]}")
            write(meta, rows)
            continue
        result = json.loads(out.read_text())
        out.unlink()
        meta.update(tokens_per_step=result["tokens_per_step"], params=result["params"])
        rows.append(summarize(result, args.warmup))
        print(f"{row}: {rows[-1]['tokens_per_s']:.0f} tokens/s ({time.monotonic() - t0:.0f} s)")
        write(meta, rows)  # after every row: a run stopped later keeps what it measured
    write(meta, rows)
    print((RESULTS / "gpu_1b.md").read_text())


def _error_line(log: str) -> str:
    """The last line of `log` naming an exception (else its last line)."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    named = [ln for ln in lines if re.search(r"\b\w*(Error|Exception)\b:", ln)]
    return (named or lines or ["?"])[-1]


def write(meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    meta = {"tokens_per_step": 0, "params": 0, **meta}
    (RESULTS / "gpu_1b.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    write_markdown(meta, rows, RESULTS / "gpu_1b.md")


if __name__ == "__main__":
    main()
