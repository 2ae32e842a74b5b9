"""Every schedule on an emulated 8-GPU, 2-node cluster, measured against the planner's plan.

    python bench/bench_emulated.py [--pp 2,4,8] [--rows gpipe,1f1b,...] [--steps 3] [--scale 10]
                                   [--out-name emulated] [--render]

Needs root (network namespaces). Writes bench/results/emulated.md and emulated.json (after every
row; `--out-name` names them otherwise, `--render` rewrites the Markdown from the JSON).

The emulated run: a reference model (Llama-2-7B's block, 4096 tokens a micro-batch, bf16) on H100s
at `EFFICIENCY` of their bf16 peak, slowed `--scale` times. Each of the stand-in GPT's 16 blocks
costs, as a timed wait on an emulated device (`emulated_device.py`), what the planner's FLOPs of
one reference block take at that rate: forward F, input gradient I = F, weight gradient W = F.
Tensors are the stand-in's (dimension 64, 64 tokens a micro-batch: tiny), and so are gathers,
reductions and messages, over per-rank emulated links (`emulated_cluster.py`: 4 ranks a node)
whose rates keep the reference's ratio of communication to compute: NVLink's 450 GB/s and
InfiniBand's 50 GB/s per GPU, times (stand-in block bytes / reference block bytes), / scale. A
stage boundary's message is scaled the same way (the stand-in's 64 tokens are chosen for it).

Rows per pipeline size pp (world 8 = pp x dp_shard, 4 pp micro-batches of one row per pipeline):
GPipe, 1F1B, Interleaved1F1B (v 2), ZB-V, DualPipeV, ZeroPP with U = pp, 2pp, 4pp (v 2, split
backward); and FSDP alone (dp_shard 8, 4 micro-batches). Each row runs in fresh processes:
warm-up steps, then timed steps (forward and backward; no optimizer step). Measured: the step
(from a barrier to the last rank's device finishing) and the bubble (the largest share of the
step a rank's device is idle). Planned: `plan.predict_step_time` of the same run, told the same
per-block seconds (`unit_seconds`), link rates and latency as measured by a calibration run on
the same emulated links (`Hardware`, overlapping collectives as on GPUs), no optimizer.
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
from common import launch_ranks, machine, proc_stat  # noqa: E402
from emulated_report import rounded, write_markdown  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
WORLD, NODE = 8, 4
STANDIN = {"vocab_size": 64, "seq_len": 64, "dim": 64, "num_heads": 2, "num_layers": 16}
REFERENCE = {
    "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 2,
    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096,
}  # fmt: skip
REFERENCE_SEQ = 4096
PEAK, EFFICIENCY = 989e12, 0.45  # H100 SXM bf16 dense; share sustained (the planner's range)
NVLINK, INFINIBAND = 450e9, 50e9  # bytes/s per GPU each way (conf/cluster/h100_*.yaml)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev", "zeropp_u1", "zeropp_u2",
             "zeropp_u4")  # fmt: skip
PG_TIMEOUT = datetime.timedelta(seconds=600)


def layout_for(row: str) -> dict[str, Any]:
    """`fsdp`, or `<schedule>@pp<n>`: the ZeroPPConfig of a row."""
    if row == "fsdp":
        return {"dp_shard_size": WORLD, "num_microbatches": 4}
    schedule, pp = row.split("@pp")
    p = int(pp)
    out: dict[str, Any] = {"pp_size": p, "dp_shard_size": WORLD // p, "num_microbatches": 4 * p}
    if schedule.startswith("zeropp_u"):
        out.update(schedule="zeropp", num_chunks=2, unit_size=p * int(schedule[-1]))
    else:
        out["schedule"] = schedule
    return out


def rows_for(pps: list[int], names: list[str]) -> list[str]:
    rows = [f"{s}@pp{p}" for p in pps for s in SCHEDULES if s in names]
    return rows + (["fsdp"] if "fsdp" in names else [])


# ---------------------------------------------------------------------------------- the run
def scaling(scale: float) -> dict[str, float]:
    """The emulated device's per-block seconds and link rates (see the module docstring)."""
    import torch

    from lightning_zeropp.models import GPT, GPTConfig
    from lightning_zeropp.models.hf import build_causal_lm
    from lightning_zeropp.plan.profile import profile_model

    with torch.device("meta"):
        ref = build_causal_lm("llama", **REFERENCE)
        standin = GPT(GPTConfig(**STANDIN))
    flops = profile_model(ref, 1, REFERENCE_SEQ, torch.bfloat16).blocks[0].flops
    forward = flops / (PEAK * EFFICIENCY) * scale
    ref_bytes = sum(p.numel() for p in ref.model.layers[0].parameters()) * 2  # bf16
    standin_bytes = (sum(p.numel() for p in standin.blocks[0].parameters()) + 1) * 4  # fp32
    ratio = standin_bytes / ref_bytes
    ref_message = REFERENCE_SEQ * REFERENCE["hidden_size"] * 2
    standin_message = STANDIN["seq_len"] * STANDIN["dim"] * 4
    return {
        "scale": scale, "block_flops": flops, "forward_s": forward,
        "bytes_ratio": ratio, "message_ratio": standin_message / ref_message,
        "intra_Bps": NVLINK * ratio / scale, "inter_Bps": INFINIBAND * ratio / scale,
    }  # fmt: skip


def run_rank(row: str, steps: int, warmup: int, forward_s: float, out: Path) -> None:
    """One rank of one row: train with the emulated device, write this rank's JSON."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from emulated_device import BlockCost, EmulatedDevice, emulate_blocks, install

    from lightning_zeropp import launch_layout
    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
    from lightning_zeropp.models import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    rank = dist.get_rank()
    config = ZeroPPConfig(node_size=NODE, **layout_for(row)).resolve(WORLD)
    cfg = GPTConfig(**STANDIN)
    torch.manual_seed(0)
    model = GPT(cfg)
    device = EmulatedDevice()
    _time_gc(device)
    cost = BlockCost(forward_s, forward_s, forward_s)
    emulate_blocks(list(model.blocks), [cost] * len(model.blocks), device)
    example = (torch.zeros(1, cfg.seq_len, dtype=torch.long),)
    engine = ZeroPPEngine(
        model, launch_layout(config), split="stack", example_args=example,
        loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
    )  # fmt: skip
    per = config.num_microbatches  # rows per data-parallel rank: one per micro-batch
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(
        0, cfg.vocab_size, (config.dp_size * per, cfg.seq_len + 1), generator=gen
    )
    mine = tokens[engine.dims.dp_rank * per : (engine.dims.dp_rank + 1) * per]
    x, y = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
    records, losses = [], []
    with install(device):
        for i in range(warmup + steps):
            device.sync()
            dist.barrier()
            device.record = i == warmup + steps - 1  # the last step's device timeline
            busy, late, cpu = device.busy, device.late, time.process_time()
            start = time.perf_counter()
            loss = engine.train_step(x, target=y)
            device.sync()
            end = time.perf_counter()
            if i >= warmup:
                records.append({"start": start, "end": end, "busy": device.busy - busy,
                                "late": device.late - late,
                                "cpu": time.process_time() - cpu})  # fmt: skip
            losses.append(float(loss))
            for p in engine.parameters():
                p.grad = None
    result = {"rank": rank, "pp_rank": engine.dims.pp_rank, "steps": records,
              "losses": losses, "spans": device.spans, "waits": device.host_waits}  # fmt: skip
    partial = out / f"rank{rank}.json.partial"
    partial.write_text(json.dumps(result))
    partial.rename(out / f"rank{rank}.json")
    dist.barrier()
    # gloo's teardown inside the namespaces hangs now and then; the figures are written
    os._exit(0)


def _time_gc(device: Any) -> None:
    """Record the garbage collector's pauses as host waits named "gc" (the idle table then tells
    them from the rest of the host's own time)."""
    import gc

    started: list[float] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started and device.record:
            device.host_waits.append(
                (f"gc{info['generation']}", started.pop(), time.perf_counter())
            )
        elif started:
            started.pop()

    gc.callbacks.append(callback)


def calibrate_rank(out: Path) -> None:
    """Message times between rank 0 and a node mate (rank 1) and another node's rank (NODE),
    and all-gathers over a node's ranks and over the world, at two sizes."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    rank = dist.get_rank()
    node = dist.new_group(list(range(NODE)))
    sizes = [2**14, 2**19]  # the larger as long as a few blocks' shards
    result: dict[str, Any] = {"rank": rank, "sizes": sizes}
    for name, peer in (("p2p_intra", 1), ("p2p_inter", NODE)):
        times = []
        for size in sizes:
            buf = torch.ones(size // 4)
            samples = []
            for _ in range(6):
                dist.barrier()
                start = time.perf_counter()
                if rank == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                elif rank == peer:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                samples.append((time.perf_counter() - start) / 2)  # one way
            times.append(min(samples[1:]))  # a loaded machine only ever adds delay
        result[name] = times
    for name, group, k in (
        ("gather_node", node, NODE), ("gather_world", None, WORLD),
        ("reduce_node", node, NODE), ("reduce_world", None, WORLD),
    ):  # fmt: skip
        times = []
        for size in sizes:
            shard = torch.ones(size // 4)
            full = torch.ones(k * shard.numel())
            samples = []
            for _ in range(4):
                dist.barrier()
                start = time.perf_counter()
                if group is None or rank < NODE:
                    if name.startswith("gather"):
                        dist.all_gather_into_tensor(full, shard, group=group)
                    else:
                        dist.reduce_scatter_tensor(shard, full, group=group)
                samples.append(time.perf_counter() - start)
            times.append(min(samples[1:]))
        result[name] = times
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)  # as run_rank: gloo's teardown inside the namespaces hangs now and then


# ---------------------------------------------------------------------------------- driver
def links(calibration: dict[str, Any]) -> dict[str, float]:
    """Latency and bandwidth of one hop inside a node and across, from rank 0's message times."""
    (small, large), out = calibration["sizes"], {}
    for where in ("intra", "inter"):
        t_small, t_large = calibration[f"p2p_{where}"]
        bw = (large - small) / max(t_large - t_small, 1e-9)
        out[f"{where}_Bps"] = bw
        out[f"{where}_latency_s"] = max(t_small - small / bw, 0.0)
    return out


def planned(row: str, s: dict[str, float], link: dict[str, float]) -> dict[str, float]:
    """The planner's step and bubble for a row, told the emulated device's costs and links."""
    import torch

    from lightning_zeropp.core import ZeroPPConfig
    from lightning_zeropp.models import GPT, GPTConfig
    from lightning_zeropp.plan import Hardware, predict_step_time
    from lightning_zeropp.plan.memory import stage_ranges

    with torch.device("meta"):
        model = GPT(GPTConfig(**STANDIN))
        for block in model.blocks:  # the emulated device's one-element weight path
            block.register_parameter("emulated_weight", torch.nn.Parameter(torch.zeros(1)))
    config = ZeroPPConfig(node_size=NODE, **layout_for(row))
    cfg = config.resolve(WORLD)
    f = s["forward_s"]
    units = [[(0.0, 0.0), *[(f, 2 * f)] * len(r)] for r in stage_ranges(model, cfg)]
    hw = Hardware(
        flops_per_s=1.0, intra_node_Bps=link["intra_Bps"], inter_node_Bps=link["inter_Bps"],
        node_size=NODE, latency_s=max(link["intra_latency_s"], link["inter_latency_s"]),
        overlap=True, rings=1,  # gloo: one ring, each member on its own emulated adapter
    )  # fmt: skip
    rows = cfg.dp_size * cfg.num_microbatches
    plan = predict_step_time(
        model, config, WORLD, rows, STANDIN["seq_len"], hw, unit_seconds=units,
        optimizer_seconds=0.0,
    )  # fmt: skip
    return {"step_s": plan.step_s, "bubble": plan.bubble}


def measured(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    steps, bubbles, late, cpu = [], [], [], []
    for i in range(len(ranks[0]["steps"])):
        start = min(r["steps"][i]["start"] for r in ranks)
        span = max(r["steps"][i]["end"] for r in ranks) - start
        steps.append(span)
        bubbles.append(max(1.0 - r["steps"][i]["busy"] / span for r in ranks))
        late.append(max(r["steps"][i]["late"] for r in ranks) / span)
        cpu.append(sum(r["steps"][i]["cpu"] for r in ranks) / span)
    return {"step_s": statistics.median(steps), "steps_s": steps,
            "bubble": statistics.median(bubbles), "host_late": statistics.median(late),
            "cpu_cores": statistics.median(cpu), "loss": ranks[0]["losses"][-1]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--pp", default="2,4,8")
    parser.add_argument("--rows", default=",".join([*SCHEDULES, "fsdp"]))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--scale", type=float, default=10.0)
    parser.add_argument(
        "--nice", type=int, default=-10,
        help="the ranks' priority (they sleep most of the time; on a shared machine a prompt "
        "wake-up is what their timing needs): nice value, or 0 to leave it",
    )  # fmt: skip
    parser.add_argument(
        "--render", action="store_true", help="rewrite <out-name>.md from <out-name>.json"
    )
    parser.add_argument(
        "--out-name", default="emulated", help="results file names (a subset run's, say)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--forward", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "calibrate":
        calibrate_rank(Path(args.out))
        return
    if args.worker:
        run_rank(args.worker, args.steps, args.warmup, args.forward, Path(args.out))
        return
    if args.render:
        saved = json.loads((RESULTS / f"{args.out_name}.json").read_text())
        write_markdown(saved, saved["rows"], RESULTS / f"{args.out_name}.md", EFFICIENCY, STANDIN)
        print((RESULTS / f"{args.out_name}.md").read_text())
        return
    from emulated_cluster import RankCluster
    from netns import unavailable

    why = unavailable()
    if why:
        raise SystemExit(f"bench_emulated: {why}")
    started, where, cpu0 = time.monotonic(), machine(), proc_stat()
    s = scaling(args.scale)
    rows = rows_for([int(p) for p in args.pp.split(",")], args.rows.split(","))
    print(f"block forward {s['forward_s'] * 1e3:.1f} ms; links {s['intra_Bps'] / 1e6:.1f} / "
          f"{s['inter_Bps'] / 1e6:.2f} MB/s; {len(rows)} rows", flush=True)  # fmt: skip
    cluster = RankCluster(
        WORLD, NODE, s["intra_Bps"] * 8 / 1e6, s["inter_Bps"] * 8 / 1e6, nice=args.nice or None
    )
    results = []
    with cluster:
        calib = launch_ranks(__file__, "calibrate", WORLD, [], 600.0, placement=cluster)[0]
        link = links(calib)
        print("calibration:", link, flush=True)
        for row in rows:
            t0, load0 = time.monotonic(), os.getloadavg()[0]
            extra = ["--steps", str(args.steps), "--warmup", str(args.warmup),
                     "--forward", str(s["forward_s"])]  # fmt: skip
            ranks = launch_ranks(__file__, row, WORLD, extra, 1800.0, placement=cluster)
            got, plan = measured(ranks), planned(row, s, link)
            results.append({"row": row, "layout": layout_for(row), "measured": got,
                            "planned": plan, "load_1m": [load0, os.getloadavg()[0]],
                            "wall_s": time.monotonic() - t0,
                            "spans": {r["rank"]: r["spans"] for r in ranks},
                            "waits": {r["rank"]: r["waits"] for r in ranks}})  # fmt: skip
            print(f"{row}: step {got['step_s']:.2f} s (plan {plan['step_s']:.2f}), bubble "
                  f"{got['bubble']:.1%} (plan {plan['bubble']:.1%}) "
                  f"[{time.monotonic() - t0:.0f} s, load {os.getloadavg()[0]:.1f}]", flush=True)  # fmt: skip
            # after every row: a run stopped early keeps what it measured
            write(where, s, calib, link, args, started, cpu0, results, done=row == rows[-1])
    print((RESULTS / f"{args.out_name}.md").read_text())


def write(
    where: dict[str, Any], s: dict[str, float], calib: dict[str, Any], link: dict[str, float],
    args: argparse.Namespace, started: float, cpu0: dict[str, int], results: list[dict[str, Any]],
    done: bool,
) -> None:  # fmt: skip
    meta = {"machine": where, "scaling": s, "calibration": calib, "links": link, "nice": args.nice,
            "steps": args.steps, "warmup": args.warmup, "wall_s": time.monotonic() - started,
            "steal_share": _steal(cpu0, proc_stat()), "load_1m_at_end": os.getloadavg()[0],
            "complete": done}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    # Compact, times to 10 us: every rank's spans make the file large.
    rows = json.dumps(rounded({**meta, "rows": results}), separators=(",", ":"))
    (RESULTS / f"{args.out_name}.json").write_text(rows)
    write_markdown(meta, results, RESULTS / f"{args.out_name}.md", EFFICIENCY, STANDIN)


def _steal(a: dict[str, int], b: dict[str, int]) -> float:
    total = sum(b.values()) - sum(a.values())
    return (b.get("steal", 0) - a.get("steal", 0)) / total if total else 0.0


if __name__ == "__main__":
    main()
