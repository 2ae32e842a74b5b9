"""ZeRO++ on an emulated cluster: bytes across and inside nodes, and step time, per technique.

    sudo .venv/bin/python bench/bench_zeropp_plus.py            # ~15 min on 2 cores
    .venv/bin/python bench/bench_zeropp_plus.py --quick         # 1 timed step per row

Each rate: the cluster's nodes become network namespaces (`bench/netns.py`) whose link is
limited to the rate scaled down by the machine's compute (see `scaled_rates`); every row runs in
fresh ranks placed in them. Rows (same model, data and global batch; bf16 weights and gradient
reduction, as DeepSpeed's ZeRO-3 runs; fp32 compute): FSDP2 over 2 nodes x 2 ranks (ZeRO-3), +qwZ, +hpZ, +qgZ,
all three (INT8 and INT4 gradients); and pipeline rows (pp 2 x dp_shard 2, 1F1B and ZeroPP,
plain and with qwZ + qgZ) on 4 nodes of 1 rank, where each stage's shard group spans 2 nodes.

Per row: median step time (slowest rank, after a barrier), bytes per step and rank sent across
and inside nodes as the kernel counted them on the links (TCP/IP included), and as the
collectives' own accounting gives them (`core.measure.traffic`, one extra counted step). Writes
`bench/results/zeropp_plus.{md,json}`. Without root or namespaces it says so and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, launch_ranks, machine  # noqa: E402

MODEL = {"vocab_size": 256, "seq_len": 128, "dim": 64, "num_heads": 4, "num_layers": 8}
GLOBAL_BATCH = 64  # 2048 tokens per data-parallel rank of 4
H100_BF16_FLOPS = 989e12  # dense bf16 peak, NVIDIA H100 SXM datasheet
# ZeRO-3 as DeepSpeed runs it: weights gathered and gradients reduced in bf16. Compute stays in
# fp32 (this CPU's bf16 matmul is ~70x slower than its fp32): weights travel as bf16
# (quantized_weights="bf16") and gradients are cast to bf16 for the reduction (reduce_dtype).
FSDP = {"dp_shard_size": 4, "quantized_weights": "bf16", "reduce_dtype": "bf16"}
PIPE = {**FSDP, "pp_size": 2, "dp_shard_size": 2, "num_microbatches": 4}
QWZ, HPZ = {"quantized_weights": "int8"}, {"hpz_partition_size": 2}
ROWS: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {  # row: ((nodes, ranks each), layout)
    "zero3": ((2, 2), FSDP),
    "+qwZ": ((2, 2), {**FSDP, **QWZ}),
    "+hpZ": ((2, 2), {**FSDP, **HPZ}),
    "+qgZ int4": ((2, 2), {**FSDP, "quantized_gradients": "int4"}),
    "all three, int8 grads": ((2, 2), {**FSDP, **QWZ, **HPZ, "quantized_gradients": "int8"}),
    "all three": ((2, 2), {**FSDP, **QWZ, **HPZ, "quantized_gradients": "int4"}),
    "1f1b": ((4, 1), {**PIPE, "schedule": "1f1b"}),
    "1f1b qwZ+qgZ": ((4, 1), {**PIPE, "schedule": "1f1b", **QWZ, "quantized_gradients": "int4"}),
    "zeropp": ((4, 1), {**PIPE, "schedule": "zeropp"}),
    "zeropp qwZ+qgZ": (
        (4, 1),
        {**PIPE, "schedule": "zeropp", **QWZ, "quantized_gradients": "int4"},
    ),
}


# ---------------------------------------------------------------------------------------- rank
def run_rank(row: str, steps: int, warmup: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_zeropp import launch_layout
    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
    from lightning_zeropp.core.measure.comm import CommCounter
    from lightning_zeropp.core.measure.traffic import NodeTraffic
    from lightning_zeropp.models import GPT, GPTConfig
    from lightning_zeropp.models.data import MarkovLanguage

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    config = ZeroPPConfig(**ROWS[row][1]).resolve(dist.get_world_size())
    torch.manual_seed(0)
    micro = GLOBAL_BATCH // config.dp_size // config.num_microbatches
    example = (torch.zeros(micro, MODEL["seq_len"], dtype=torch.long),)

    def loss_fn(logits: Any, y: Any) -> Any:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    engine = ZeroPPEngine(
        GPT(GPTConfig(**MODEL)),
        launch_layout(config),
        loss_fn=loss_fn,
        split="stack",
        example_args=example,
    )
    opt = torch.optim.AdamW(engine.parameters(), lr=1e-3)
    tokens = MarkovLanguage(MODEL["vocab_size"]).sample(GLOBAL_BATCH * (MODEL["seq_len"] + 1), 1)
    tokens = tokens.view(GLOBAL_BATCH, -1)
    per = GLOBAL_BATCH // config.dp_size
    rows = slice(engine.dims.dp_rank * per, (engine.dims.dp_rank + 1) * per)
    x, y = tokens[rows, :-1].contiguous(), tokens[rows, 1:].contiguous()
    node_leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
    times, losses, kernel0 = [], [], None
    traffic = NodeTraffic(engine.dims.mesh, config.node_size)
    summary: dict[str, Any] = {}
    for i in range(warmup + steps + 1):
        dist.barrier()
        if i == warmup:
            kernel0 = _link_bytes() if node_leader else None
        start = time.perf_counter()
        if i == warmup + steps:  # one more, counted, after the kernel's counters are read
            with CommCounter(traffic) as counter:
                loss = engine.train_step(x, target=y)
            summary = counter.summary()
        else:
            loss = engine.train_step(x, target=y)
        opt.step()
        opt.zero_grad()
        if warmup <= i < warmup + steps:
            times.append(time.perf_counter() - start)
        if i == warmup + steps - 1:
            dist.barrier()
            kernel = _link_bytes() if node_leader else None
        losses.append(float(loss))
    step_times = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(step_times, op=dist.ReduceOp.MAX)
    result = {
        "step_times_s": step_times.tolist(),
        "losses": losses,
        "sent": traffic.sent(summary),
        "summary": summary,
        "kernel": {k: kernel[k] - kernel0[k] for k in kernel} if node_leader else None,
    }
    rank = dist.get_rank()
    (out / f"rank{rank}.json.partial").write_text(json.dumps(result))
    (out / f"rank{rank}.json.partial").rename(out / f"rank{rank}.json")
    dist.barrier()
    dist.destroy_process_group()


def _link_bytes() -> dict[str, int]:
    """This node's bytes sent so far: on its link (gloo's interface) and on its loopback."""

    def tx(dev: str) -> int:
        return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())

    return {"cross_node": tx(os.environ["GLOO_SOCKET_IFNAME"]), "in_node": tx("lo")}


# -------------------------------------------------------------------------------------- driver
def matmul_flops() -> float:
    """One core's fp32 matmul rate (FLOP/s): the ranks' compute."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(3):
        a @ b
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < 1.0:
        a @ b
        n += 1
    return 2 * 512**3 * n / (time.perf_counter() - start)


def scaled_rates(flops: float, world: int = 4) -> dict[str, Any]:
    """Link rates divided by (H100 bf16 peak / one rank's share of this machine's matmul rate),
    so a step's compute-to-communication ratio resembles the cluster's
    (`conf/cluster/h100_4x8.yaml`)."""
    import yaml

    cluster = yaml.safe_load((ROOT / "conf" / "cluster" / "h100_4x8.yaml").read_text())
    per_rank = flops * min(os.cpu_count() or 1, world) / world
    factor = H100_BF16_FLOPS / per_rank
    nvlink_gbit = cluster["bandwidth_GBps"]["intra_node"] * 8
    return {
        "factor": factor,
        "intra_mbit": nvlink_gbit * 1e3 / factor,
        "inter_mbit": {f"{g} Gb/s": g * 1e3 / factor for g in (100, 400)},
    }


def run_rows(rates: dict[str, Any], steps: int, warmup: int) -> list[dict[str, Any]]:
    from netns import EmulatedCluster

    script = str(Path(__file__).resolve())
    results = []
    for link, inter in rates["inter_mbit"].items():
        for shape in sorted({shape for shape, _ in ROWS.values()}):
            names = [n for n, (s, _) in ROWS.items() if s == shape]
            with EmulatedCluster(*shape, inter_mbit=inter, intra_mbit=rates["intra_mbit"]) as c:
                for name in names:
                    print(f"[{link}] {name} on {shape[0]} nodes x {shape[1]}", flush=True)
                    ranks = launch_ranks(
                        script, name, shape[0] * shape[1],
                        ["--steps", str(steps), "--warmup", str(warmup)],
                        timeout_s=1800, placement=c,
                    )  # fmt: skip
                    results.append(summarize(link, name, shape, ranks, steps))
    return results


def summarize(link: str, row: str, shape: tuple[int, int], ranks: list[dict], steps: int) -> dict:
    world = shape[0] * shape[1]
    kernel = [r["kernel"] for r in ranks if r["kernel"] is not None]
    per = {k: sum(n[k] for n in kernel) / steps / world for k in ("cross_node", "in_node")}
    counted = {k: sum(r["sent"][k] for r in ranks) / world for k in ("cross_node", "in_node")}
    return {
        "link": link, "row": row, "nodes": shape[0], "ranks_per_node": shape[1],
        "median_step_s": statistics.median(ranks[0]["step_times_s"]),
        "step_times_s": ranks[0]["step_times_s"],
        "kernel_bytes_per_step_rank": per, "counted_bytes_per_step_rank": counted,
        "losses": ranks[0]["losses"], "layout": ROWS[row][1],
    }  # fmt: skip


def write(meta: dict[str, Any], rows: list[dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "zeropp_plus.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    r = meta["rates"]
    lines = [
        "# ZeRO++ on an emulated cluster (`bench/bench_zeropp_plus.py`)",
        "",
        f"Machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores; torch "
        f"{meta['machine']['torch']}; {meta['machine']['date']}; commit {meta['machine']['commit']}.",
        f"One core's fp32 matmul: {meta['flops'] / 1e9:.1f} GFLOP/s ({meta['machine']['cores']} "
        "cores for 4 ranks); link rates are the "
        f"H100 cluster's divided by {r['factor']:.3g}: NVLink (450 GB/s) -> "
        f"{r['intra_mbit']:.1f} Mbit/s on each node's loopback; InfiniBand "
        + ", ".join(f"{k} -> {v:.2f} Mbit/s" for k, v in r["inter_mbit"].items())
        + " on each node's link, both directions.",
        f"Model: GPT {MODEL}, global batch {GLOBAL_BATCH} x {MODEL['seq_len']} tokens; "
        f"{meta['steps']} timed steps after {meta['warmup']} warm-up.",
        "",
        "| link | row | nodes x ranks | median step | vs zero3 | cross-node MB/step/rank "
        "(kernel) | (counted) | x zero3 | in-node MB (kernel) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(x["link"], x["nodes"]): x for x in rows if x["row"] in ("zero3", "1f1b")}
    for x in rows:
        b = base[(x["link"], x["nodes"])]
        k, c = x["kernel_bytes_per_step_rank"], x["counted_bytes_per_step_rank"]
        bc = b["counted_bytes_per_step_rank"]["cross_node"]
        lines.append(
            f"| {x['link']} | {x['row']} | {x['nodes']} x {x['ranks_per_node']} | "
            f"{x['median_step_s']:.2f} s | {b['median_step_s'] / x['median_step_s']:.2f}x | "
            f"{k['cross_node'] / 1e6:.3f} | {c['cross_node'] / 1e6:.3f} | "
            f"{c['cross_node'] / bc:.2f} | {k['in_node'] / 1e6:.3f} |"
        )
    (out / "zeropp_plus.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.worker:
        run_rank(args.worker, args.steps, args.warmup, args.out)
        return
    from netns import unavailable

    if reason := unavailable():
        print(f"bench_zeropp_plus: skipped, {reason}")
        return
    steps = 1 if args.quick else args.steps
    flops = matmul_flops()
    rates = scaled_rates(flops)
    print(f"fp32 matmul {flops / 1e9:.1f} GFLOP/s; rates {rates}", flush=True)
    rows = run_rows(rates, steps, args.warmup)
    meta = {"machine": machine(), "flops": flops, "rates": rates, "steps": steps,
            "warmup": args.warmup}  # fmt: skip
    out = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
    write(meta, rows, out)
    print((out / "zeropp_plus.md").read_text())


if __name__ == "__main__":
    main()
