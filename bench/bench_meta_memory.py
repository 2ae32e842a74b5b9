"""Peak host memory per rank: a Llama built whole on every rank against one built on the meta
device and loaded from safetensors, each rank reading only its own shards.

    .venv/bin/python bench/bench_meta_memory.py            # ~1.5B meta row + the 0.4B pair
    .venv/bin/python bench/bench_meta_memory.py --quick    # small shapes, a minute

Rows (4 CPU ranks, SGD):
- `whole-0.4b` / `meta-0.4b`: the same ~0.4B model under pp 2 x dp_shard 2 (1F1B), built whole
  on every rank (then split and sharded), or built empty and loaded from an HF safetensors
  directory;
- `meta-1.5b`: a ~1.4B model (5.2 GiB in fp32) under the ZeroPP schedule (pp 2 x dp_shard 2,
  8 chunks per rank, gradients reduced per micro-batch), loaded from safetensors with every
  rank in a memory cgroup capped at 0.95 x the whole model's size. The whole-model path cannot
  run it here (4 whole copies do not fit the machine).

Per rank: resident memory after imports (baseline), after the engine is built, and the process
peak over two training steps; against it, the rank's share (its parameter and gradient shards,
no optimizer state under SGD) plus the most gathered weights seen at once (measured in the first
step). The gap is activations, communication buffers and allocator slack.

Writes bench/results/meta_memory.{json,md} with the machine, date and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, launch_ranks, machine  # noqa: E402

sys.path.insert(0, str(ROOT))  # tests.distributed.capped_scenarios writes the weights

WORLD = 4
PP2 = {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 2}  # 1F1B over FSDP2
# The ~1.4B model under the ZeroPP schedule, 8 chunks per rank, gradients reduce-scattered after
# every micro-batch: a rank then holds one small chunk's gathered weights and unsharded gradients
# at a time beside its shards. Under 1F1B (or FSDP alone through the engine) torch's pipeline
# runtime keeps a stage's unsharded gradients until the end of the step: more than this
# machine's 4 ranks hold at 1.4B.
ZEROPP = {
    "pp_size": 2,
    "dp_shard_size": 2,
    "schedule": "zeropp",
    "num_chunks": 8,
    "unit_size": 2,
    "num_microbatches": 2,
    "grad_reduce": "microbatch",
}
LAYOUTS = {"0.4b": PP2, "1.5b": ZEROPP, "tiny": PP2}
SHAPES = {  # Llama-shaped, grouped-query attention
    "0.4b": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24,
             "num_attention_heads": 16, "num_key_value_heads": 4},
    "1.5b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 4},
    "tiny": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 8,
             "num_attention_heads": 8, "num_key_value_heads": 2},
}  # fmt: skip
VOCAB, SEQ, ROWS = 32000, 32, 4  # global batch: 4 rows of 32 tokens
DEFAULT_ROWS = "whole-0.4b,meta-0.4b,meta-1.5b"


def _config(shape: str) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False, **SHAPES[shape]
    )


# ---------------------------------------------------------------------- the weights on disk
def write_weights(shape: str, root: Path) -> Path:
    """An HF directory of random weights, one safetensors file per layer: written tensor by
    tensor, never the whole model in memory (the slow capped-memory test's writer)."""
    from tests.distributed.capped_scenarios import write_weights as write_hf_weights

    return write_hf_weights(_config(shape), root / f"llama-{shape}")


# ---------------------------------------------------------------------- one rank
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _join_cgroup(cap: int) -> bool:
    """Join this rank's capped memory cgroup (root, cgroup v1) before torch is imported."""
    from tests.distributed.cgroup import join_memory_cgroup  # imports nothing heavy

    try:
        join_memory_cgroup(cap)
    except OSError as err:
        print(f"memory cap not enforced ({err}); peaks are measured all the same")
        return False
    return True


def worker(row: str, out: Path, weights: str, cap: int) -> None:
    rank = int(os.environ["RANK"])
    capped = _join_cgroup(cap) if cap else False
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from lightning_zeropp import launch_layout
    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
    from lightning_zeropp.core.measure.memory import host_peak_bytes
    from lightning_zeropp.core.shard.fsdp import local_shard
    from lightning_zeropp.core.weights.materialize import empty_parameters

    dist.init_process_group("gloo")
    baseline = _rss()
    kind, shape = row.split("-")
    config = _config(shape)
    start = time.monotonic()
    if kind == "whole":
        model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
        model.config.use_cache = False
        load_from = None
    else:
        with empty_parameters():
            model = AutoModelForCausalLM.from_config(config)
        load_from = weights
    built_whole = _rss()

    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())

    cfg = ZeroPPConfig(**LAYOUTS[shape]).resolve(WORLD)
    micro = ROWS // cfg.dp_size // cfg.num_microbatches
    example = (torch.zeros(micro, SEQ, dtype=torch.long),)
    engine = ZeroPPEngine(
        model, launch_layout(cfg), loss_fn=loss_fn, example_args=example, load_from=load_from
    )
    del model
    setup_s = time.monotonic() - start
    at_setup = _rss()
    opt = torch.optim.SGD(engine.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses, step_s = [], []
    for _ in range(2):
        x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        per = ROWS // engine.dims.dp_size
        rows = slice(engine.dims.dp_rank * per, (engine.dims.dp_rank + 1) * per)
        t = time.monotonic()
        losses.append(float(engine.train_step(x[rows], target=x[rows])))
        opt.step()
        opt.zero_grad()  # torch's default (set_to_none=True), as Lightning and Accelerate call it
        step_s.append(time.monotonic() - t)
    shards = sum(local_shard(p).numel() * 4 for p in engine.parameters())
    result = {
        "row": row,
        "rank": rank,
        "capped": capped,
        "cap_bytes": cap,
        "baseline": baseline,
        "after_build_whole_or_meta": built_whole,
        "at_setup": at_setup,
        "peak": host_peak_bytes(),
        "param_shard_bytes": shards,
        "grad_shard_bytes": shards,
        "gathered_peak": engine.gathered_peak,
        "losses": losses,
        "setup_s": setup_s,
        "step_s": step_s,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# ---------------------------------------------------------------------- the table
def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def report(rows: dict[str, list[dict[str, Any]]], sizes: dict[str, int], facts: dict) -> str:
    lines = [
        "# Peak host memory per rank: whole-model build against meta build + sharded load",
        "",
        f"Machine: {json.dumps(facts)}",
        "",
        f"4 CPU ranks, SGD, {ROWS} rows x {SEQ} tokens per step, 2 steps; layouts {LAYOUTS}. "
        "GiB; 'above baseline' subtracts each rank's resident memory after imports (Python, "
        "torch, transformers). budget = this rank's parameter + gradient shards (fp32) + twice "
        "the most unsharded weights seen at once (measured in the first step): the gathered "
        "weights and their unsharded gradients.",
        "",
        "| row | model fp32 | rank | capped at | baseline | at setup | peak | peak above baseline "
        "| budget | ratio | setup s | step s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row, ranks in rows.items():
        for r in sorted(ranks, key=lambda x: x["rank"]):
            above = r["peak"] - r["baseline"]
            gathered = r["gathered_peak"] or 0
            budget = r["param_shard_bytes"] + r["grad_shard_bytes"] + 2 * gathered
            cap = _gib(r["cap_bytes"]) if r["capped"] else "-"
            steps = "/".join(f"{s:.0f}" for s in r["step_s"])
            lines.append(
                f"| {row} | {_gib(sizes[row])} | {r['rank']} | {cap} | {_gib(r['baseline'])} "
                f"| {_gib(r['at_setup'])} | {_gib(r['peak'])} | {_gib(above)} | {_gib(budget)} "
                f"| {above / budget:.2f} | {r['setup_s']:.0f} | {steps} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker")
    parser.add_argument("--out")
    parser.add_argument("--weights", default="")
    parser.add_argument("--cap", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", default=DEFAULT_ROWS)
    parser.add_argument(
        "--cap-fraction", type=float, default=0.95, help="meta-1.5b's cap, of the model's bytes"
    )
    parser.add_argument("--data", default="/tmp/zeropp_meta_memory")
    a = parser.parse_args()
    # glibc raises its mmap threshold to the size of each large block freed, after which blocks
    # of that size come from the heap and stay resident when freed: on CPU ranks that keeps
    # freed gathers and gradient buffers counted in the peak. A fixed 1 MiB threshold returns
    # every large tensor to the system when it is freed (GPU memory has its own allocator).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    if a.worker:
        worker(a.worker, Path(a.out), a.weights, a.cap)
        return
    facts = machine()
    data = Path(a.data)
    plan = ["whole-tiny", "meta-tiny"] if a.quick else a.rows.split(",")
    rows: dict[str, list[dict[str, Any]]] = {}
    sizes: dict[str, int] = {}
    failed: dict[str, str] = {}
    for row in plan:
        shape = row.split("-")[1]
        weights = write_weights(shape, data)
        # fp32 on disk: the whole model's bytes
        size = sum(f.stat().st_size for f in weights.glob("*.safetensors"))
        sizes[row] = size
        cap = int(a.cap_fraction * size) if row == "meta-1.5b" else 0  # below the whole model
        args = ["--weights", str(weights), "--cap", str(cap)]
        print(f"{row}: model {_gib(size)} GiB, cap {_gib(cap) if cap else '-'}", flush=True)
        try:
            rows[row] = launch_ranks(__file__, row, WORLD, args, timeout_s=1800)
        except RuntimeError as err:  # e.g. the memory cap killed its ranks: say so
            failed[row] = f"{str(err).splitlines()[0]} (cap {_gib(cap) if cap else '-'} GiB)"
            print(err, flush=True)
    text = report(rows, sizes, facts)
    text += "".join(f"\n- `{row}` did not finish: {why}\n" for row, why in failed.items())
    print(text)
    results = ROOT / "bench" / "results"
    # A partial run (--rows, --quick) writes beside the full run's files, not over them.
    name = "meta_memory" if plan == DEFAULT_ROWS.split(",") else "meta_memory_partial"
    (results / f"{name}.md").write_text(text)
    (results / f"{name}.json").write_text(
        json.dumps({"machine": facts, "sizes": sizes, "rows": rows, "failed": failed}, indent=1)
    )


if __name__ == "__main__":
    main()
