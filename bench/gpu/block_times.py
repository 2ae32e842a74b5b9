"""One 1B-class Llama decoder layer on one GPU: forward, backward, and the backward's input- and
weight-gradient halves, eager and compiled, for the planner's step-time model.

    python bench/gpu/block_times.py [--rows 1,2,4] [--repeats 10]
    python bench/gpu/block_times.py --device cpu --tiny     # a dry run on the CPU

The layer is conf/model/llama_1b.yaml's (2048 wide, 32 heads, 4 KV heads, MLP 5632) in bf16, on
micro-batches of `--rows` x 2048 tokens. Per mode (eager; compiled whole, as under full-backward
schedules; compiled regions, as under split-backward ones: `core.shard.compile`): median times of
F (forward, keeping what backward needs), B (full backward), I then W (torch's split backward:
`stage_backward_input`, `stage_backward_weight`), each CUDA-synchronized; achieved TFLOP/s from the
layer's FLOPs (torch's FlopCounterMode on the forward; a backward counted as twice it); and W's
share of I + W, what the planner calls `weight_share`. Writes bench/results/gpu_blocks.json and
gpu_blocks.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
SHAPES = {
    "1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32,
           "num_key_value_heads": 4, "seq": 2048},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "seq": 32},
}  # fmt: skip
MODES = ("eager", "whole", "regions")


def measure(
    device: str, shape_name: str, rows_list: list[int], repeats: int, report: Any
) -> list[dict]:
    """Every (rows, mode) measurement; `report(rows_so_far)` after each."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_zeropp.core._torch_private import stage_backward_input, stage_backward_weight
    from lightning_zeropp.core.shard.compile import compile_blocks, compile_stats
    from lightning_zeropp.models.hf import build_causal_lm

    shape = dict(SHAPES[shape_name])
    seq = shape.pop("seq")
    dev = torch.device(device)
    torch.manual_seed(0)
    with dev:
        net = build_causal_lm(
            "llama", seed=0, num_hidden_layers=2, vocab_size=128, max_position_embeddings=seq,
            **shape,
        )  # fmt: skip
    net = net.to(torch.bfloat16)
    base = net.model.layers[0]
    rotary = net.model.rotary_emb

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn: Any) -> tuple[float, Any]:
        sync()
        start = time.perf_counter()
        value = fn()
        sync()
        return time.perf_counter() - start, value

    def once(layer: Any, x0: Any, cos_sin: Any, dy: Any, split: bool) -> tuple[float, ...]:
        """F and B, then (when `split`) I and W of one micro-batch, in seconds."""

        def forward(x: Any) -> Any:
            y = layer(x, position_embeddings=cos_sin)
            return y[0] if isinstance(y, tuple) else y

        x = x0.detach().requires_grad_()
        f, y = timed(lambda: forward(x))
        b, _ = timed(lambda: y.backward(dy))
        layer.zero_grad(set_to_none=True)
        if not split:  # a whole compiled block has no separate weight gradients
            return f, b, float("nan"), float("nan")
        x = x0.detach().requires_grad_()
        y = forward(x)
        i, (_, groups) = timed(lambda: stage_backward_input([y], [dy], [x], layer.parameters()))
        w, _ = timed(lambda: stage_backward_weight(layer.parameters(), groups))
        layer.zero_grad(set_to_none=True)
        return f, b, i, w

    out = []
    for rows in rows_list:
        x0 = torch.randn(rows, seq, shape["hidden_size"], device=dev, dtype=torch.bfloat16)
        pos = torch.arange(seq, device=dev).unsqueeze(0).expand(rows, -1)
        cos_sin = rotary(x0, pos)
        dy = torch.randn_like(x0)
        # counted with an explicit causal mask: without one HF asks SDPA for grouped-query
        # attention (`enable_gqa`) on CUDA, whose shapes torch 2.11's FLOP counter rejects; the
        # mask changes no matrix product's size (the counter counts whole attention either way)
        causal = torch.ones(seq, seq, device=dev, dtype=torch.bool).tril()[None, None]
        with FlopCounterMode(display=False) as counter:
            base(x0, position_embeddings=cos_sin, attention_mask=causal.expand(rows, 1, -1, -1))
        flops_f = counter.get_total_flops()
        for mode in MODES:
            layer = copy.deepcopy(base)
            if mode != "eager":
                compile_blocks(torch.nn.ModuleList([layer]), ["0"], regions=mode == "regions")
            before = compile_stats()
            samples: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": []}
            for i in range(repeats + 2):  # two warm-up rounds (the first compiles)
                times = once(layer, x0, cos_sin, dy, split=mode != "whole")
                if i >= 2:
                    for key, value in zip("FBIW", times, strict=True):
                        samples[key].append(value)
            med = {k: statistics.median(v) for k, v in samples.items()}  # nan: not measured
            stats = {k: v - before.get(k, 0) for k, v in compile_stats().items()}
            out.append(
                {
                    "rows": rows,
                    "tokens": rows * seq,
                    "mode": mode,
                    **{f"{k}_ms": 1e3 * v for k, v in med.items()},
                    "forward_flops": flops_f,
                    "F_tflops": flops_f / med["F"] / 1e12,
                    "B_tflops": 2 * flops_f / med["B"] / 1e12,
                    "IW_tflops": 2 * flops_f / (med["I"] + med["W"]) / 1e12,
                    "weight_share": med["W"] / (med["I"] + med["W"]),
                    "fallbacks": stats.get("fallbacks", 0),
                    "compiled_runs": stats.get("whole_runs", 0) + stats.get("split_runs", 0),
                }
            )
            print(json.dumps(out[-1]), flush=True)
            report(out)  # after each: a run stopped later keeps what it measured
    return out


def write_markdown(meta: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    out = [
        "## Per-block times for the planner (one llama_1b decoder layer, bf16)",
        "",
        f"Machine: {json.dumps(meta.get('machine', {}))}",
        "",
        f"{meta['device']}, {meta['shape']} shape, median of {meta['repeats']} repeats. "
        "`python bench/gpu/block_times.py`. F: forward; B: full backward; I, W: torch's split "
        "backward (input, then weight gradients); TFLOP/s from torch's FlopCounterMode (backward "
        "= 2 x forward); weight share = W / (I + W).",
        "",
        "| tokens | mode | F ms | B ms | I ms | W ms | F TFLOP/s | B TFLOP/s | I+W TFLOP/s | "
        "weight share | compiled runs | fallbacks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['tokens']} | {r['mode']} | {r['F_ms']:.2f} | {r['B_ms']:.2f} | "
            f"{r['I_ms']:.2f} | {r['W_ms']:.2f} | {r['F_tflops']:.1f} | {r['B_tflops']:.1f} | "
            f"{r['IW_tflops']:.1f} | {r['weight_share']:.2f} | {r['compiled_runs']} | "
            f"{r['fallbacks']} |"
        )
    path.write_text("\n".join(out) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    import torch

    shape = "tiny" if args.tiny else "1b"
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    sys.path.insert(0, str(ROOT))  # run as a script: bench/ is a package of the repository
    from bench.common import machine

    meta = {"device": device, "shape": shape, "repeats": args.repeats, "machine": machine()}
    RESULTS.mkdir(parents=True, exist_ok=True)

    def report(rows: list[dict[str, Any]]) -> None:
        (RESULTS / "gpu_blocks.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        write_markdown(meta, rows, RESULTS / "gpu_blocks.md")

    measure(args.device, shape, [int(r) for r in args.rows.split(",")], args.repeats, report)
    print((RESULTS / "gpu_blocks.md").read_text())


if __name__ == "__main__":
    main()
