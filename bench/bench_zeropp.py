"""ZeroPP against the other ways to lay out the same model, on 4 and 8 CPU gloo ranks.

    python bench/bench_zeropp.py [--worlds 4,8] [--steps 4] [--warmup 2] [--rows zeropp_u1,...]

Rows (same GPT, same global batch, AdamW, fp32, no recomputation, one run, each row in its own
fresh processes): ZeroPP with U = pp and U = 2pp (v = 2, split backward), and U = pp with the
gradients reduce-scattered per unit and per micro-batch instead of per step; 1F1B over FSDP2 with
per-micro-batch re-gathering (reshard after forward); 1F1B over FSDP2 without resharding;
Interleaved1F1B (v = 2, no resharding); FSDP2 alone; and a 3-D baseline: tensor parallelism from
`torch.distributed.tensor.parallel` (tp = 2) x 1F1B x FSDP2. Layouts: world 4 = pp 2 x dp_shard 2
(TP row: pp 2 x tp 2), world 8 = pp 4 x dp_shard 2 (TP row: pp 2 x tp 2 x dp_shard 2).

Per row and step: median time (slowest rank), collective bytes per kind and mesh axis (mean over
ranks), peak memory per rank split into parameters, gradients, optimizer state (local shards),
gathered weights and tensors saved for backward (activations), and the bubble fraction measured
from the rank timelines (`core.measure.timeline`). Written to bench/results/zeropp.md and .json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch_ranks, machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
MODEL = {"vocab_size": 256, "seq_len": 64, "dim": 128, "num_heads": 4, "num_layers": 8}
GLOBAL_BATCH = 32
MICROBATCHES = 8  # per pipeline and step, for every pipelined row
MIB = 2**20


def rows_for(world: int) -> dict[str, dict[str, Any]]:
    pp = 2 if world == 4 else 4
    dp = world // pp
    pipe = {"pp_size": pp, "dp_shard_size": dp, "num_microbatches": MICROBATCHES}
    return {
        "zeropp_u1": {
            "title": f"ZeroPP U=pp={pp} (v=2)",
            "layout": {**pipe, "schedule": "zeropp", "num_chunks": 2, "unit_size": pp},
        },
        "zeropp_u1_rs_unit": {
            "title": f"ZeroPP U=pp={pp}, reduce-scatter per unit",
            "layout": {
                **pipe,
                "schedule": "zeropp",
                "num_chunks": 2,
                "unit_size": pp,
                "grad_reduce": "unit",
            },
        },
        "zeropp_u1_rs_mb": {
            "title": f"ZeroPP U=pp={pp}, reduce-scatter per micro-batch",
            "layout": {
                **pipe,
                "schedule": "zeropp",
                "num_chunks": 2,
                "unit_size": pp,
                "grad_reduce": "microbatch",
            },
        },
        "zeropp_u2": {
            "title": f"ZeroPP U=2pp={2 * pp} (v=2)",
            "layout": {**pipe, "schedule": "zeropp", "num_chunks": 2, "unit_size": 2 * pp},
        },
        "1f1b_regather": {
            "title": "1F1B/FSDP2, re-gather per micro-batch",
            "layout": {**pipe, "schedule": "1f1b", "reshard_after_forward": True},
        },
        "1f1b_keep": {
            "title": "1F1B/FSDP2, no reshard",
            "layout": {**pipe, "schedule": "1f1b", "reshard_after_forward": False},
        },
        "interleaved": {
            "title": "Interleaved1F1B/FSDP2 (v=2)",
            "layout": {**pipe, "schedule": "interleaved_1f1b", "num_chunks": 2},
        },
        "fsdp2": {"title": f"FSDP2 alone (dp_shard={world})", "layout": {"dp_shard_size": world}},
        "tp_pp_dp": {
            "title": f"3-D: TP 2 x 1F1B pp 2 x FSDP2 dp {world // 4}",
            "layout": None,  # built by hand below: the core has no tensor parallelism
            "tp": {"pp": 2, "tp": 2, "dp": world // 4},
        },
    }


def row_timeout_s(world: int, steps: int, warmup: int) -> float:
    return 180.0 + (12.0 if world == 4 else 30.0) * (warmup + steps + 2)


# ---------------------------------------------------------------------------------------- rank
def run_rank(row: str, world: int, steps: int, warmup: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from lightning_zeropp.core.measure.memory import model_state_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    spec = rows_for(world)[row]
    job = _tp_job(spec["tp"]) if spec["layout"] is None else _engine_job(spec["layout"], world)
    opt = torch.optim.AdamW(job["params"], lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(
        0, MODEL["vocab_size"], (GLOBAL_BATCH, MODEL["seq_len"] + 1), generator=gen
    )
    per = GLOBAL_BATCH // job["dp_size"]
    rows = slice(job["dp_rank"] * per, (job["dp_rank"] + 1) * per)
    x, y = tokens[rows, :-1].contiguous(), tokens[rows, 1:].contiguous()

    times, losses = [], []
    cpu_s = wall_s = 0.0
    comm = timeline = held = None
    for i in range(warmup + steps + 2):
        timed = warmup <= i < warmup + steps
        if i == warmup:
            cpu0, wall0 = time.process_time(), time.perf_counter()
        dist.barrier()
        start = time.perf_counter()
        if i == warmup + steps:  # one extra step counts the traffic (counting never skews timing)
            from lightning_zeropp.core.measure.comm import CommCounter

            with CommCounter(job["namer"]) as counter:
                loss = job["step"](x, y)
            comm = counter.summary()
        elif i == warmup + steps + 1:  # and one records the timeline and memory
            with job["recorder"]() as rec:
                loss = job["step"](x, y)
            timeline = rec.timeline
            held = model_state_bytes(job["params"], opt)
        else:
            loss = job["step"](x, y)
        opt.step()
        elapsed = time.perf_counter() - start
        if timed:
            times.append(elapsed)
        if i == warmup + steps - 1:
            cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
        losses.append(float(loss))
        opt.zero_grad(set_to_none=True)
    step_times = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(step_times, op=dist.ReduceOp.MAX)
    result = {
        "rank": rank,
        "pp_rank": job["pp_rank"],
        "step_times_s": step_times.tolist(),
        "losses": losses,
        "timed_cpu_s": cpu_s,
        "timed_wall_s": wall_s,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "held_bytes": held,
        "comm": comm,
        "timeline": timeline.to_dict(),
    }
    partial = out / f"rank{rank}.json.partial"
    partial.write_text(json.dumps(result))
    partial.rename(out / f"rank{rank}.json")
    dist.barrier()
    dist.destroy_process_group()


def _loss_fn(logits: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _engine_job(layout: dict[str, Any], world: int) -> dict[str, Any]:
    import torch

    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
    from lightning_zeropp.core.measure.comm import mesh_axis_namer
    from lightning_zeropp.core.measure.timeline import StepRecorder
    from lightning_zeropp.models import GPT, GPTConfig

    torch.manual_seed(0)
    config = ZeroPPConfig(**layout).resolve(world)
    micro = GLOBAL_BATCH // config.dp_size // config.num_microbatches
    example = (torch.zeros(micro, MODEL["seq_len"], dtype=torch.long),)
    engine = ZeroPPEngine(
        GPT(GPTConfig(**MODEL)), config, loss_fn=_loss_fn, split="stack", example_args=example
    )
    return {
        "params": list(engine.parameters()),
        "dp_size": engine.dims.dp_size,
        "dp_rank": engine.dims.dp_rank,
        "pp_rank": engine.dims.pp_rank,
        "namer": mesh_axis_namer(engine.dims.mesh),
        "step": lambda x, y: engine.train_step(x, target=y),
        "recorder": lambda: StepRecorder(engine),
    }


def _tp_job(sizes: dict[str, int]) -> dict[str, Any]:
    """TP x PP x DP on the same GPT, from torch's own pieces (the core has no tensor parallelism).

    Attention uses separate q/k/v projections so that column-parallel heads stay whole (the fused
    qkv of the bundled GPT would mix q, k and v across TP ranks): the same parameter count and
    FLOPs, not the same numbers.
    """
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from lightning_zeropp.core.measure.comm import mesh_axis_namer
    from lightning_zeropp.core.measure.timeline import StepRecorder
    from lightning_zeropp.models import GPT, GPTConfig

    class HeadParallelAttention(nn.Module):
        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.heads, self.head_dim = heads, dim // heads
            self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
            self.proj = nn.Linear(dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = (
                f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v)
            )  # -1: the heads local to this TP rank
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, -1))

    pp, tp, dp = sizes["pp"], sizes["tp"], sizes["dp"]
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp_shard", "tp"))
    pp_rank = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    cfg = GPTConfig(**MODEL)
    model = GPT(cfg)
    per_stage = cfg.num_layers // pp
    keep = range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
    model.blocks = nn.ModuleList([model.blocks[i] for i in keep])
    if pp_rank != 0:
        model.tok_emb = model.pos_emb = None  # type: ignore[assignment]
    if pp_rank != pp - 1:
        model.norm = model.head = None  # type: ignore[assignment]
    for block in model.blocks:
        block.attn = HeadParallelAttention(cfg.dim, cfg.num_heads)
        parallelize_module(
            block,
            mesh["tp"],
            {
                "attn.q": ColwiseParallel(),
                "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.0": ColwiseParallel(),
                "mlp.2": RowwiseParallel(),
            },
        )
        fully_shard(block, mesh=mesh["dp_shard"], reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp_shard"], reshard_after_forward=False)
    stage = PipelineStage(model, pp_rank, pp, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=_loss_fn, scale_grads=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if pp_rank == 0:
            schedule.step(x, target=y, losses=losses)
        else:
            schedule.step(target=y, losses=losses)
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        torch.distributed.broadcast(loss, group=mesh["pp"].get_group(), group_src=pp - 1)
        return loss

    class _Job:  # what StepRecorder reads from an engine
        stages = [stage]
        dims = type("Dims", (), {"mesh": mesh})

    return {
        "params": list(model.parameters()),
        "dp_size": dp,
        "dp_rank": mesh["dp_shard"].get_local_rank(),
        "pp_rank": pp_rank,
        "namer": mesh_axis_namer(mesh),
        "step": step,
        "recorder": lambda: StepRecorder(_Job()),
    }


# ---------------------------------------------------------------------------------------- driver
def summarize(world: int, row: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    from lightning_zeropp.core.measure.timeline import Timeline, bubble_fraction

    spec = rows_for(world)[row]
    comm: dict[str, float] = {}
    for r in ranks:
        for kind, axes in (r["comm"] or {}).items():
            for axis, stats in axes.items():
                key = f"{kind}@{axis}"
                comm[key] = comm.get(key, 0.0) + stats["bytes"] / len(ranks)
    timelines = [Timeline.from_dict(r["timeline"]) for r in ranks]
    # the bubble of one pipeline: its ranks are those of data-parallel group 0 (all alike)
    pipelines: dict[int, Timeline] = {}
    for r, tl in zip(ranks, timelines, strict=True):
        pipelines.setdefault(r["pp_rank"], tl)
    mem = {
        k: max(r["held_bytes"][k] for r in ranks)
        for k in ("parameters", "gradients", "optimizer_state")
    }
    mem["gathered_weights"] = max(t.peak_unsharded_bytes for t in timelines)
    mem["activations"] = max(t.peak_activation_bytes for t in timelines)
    cpu_share = sum(r["timed_cpu_s"] for r in ranks) / (
        max(r["timed_wall_s"] for r in ranks) * (os.cpu_count() or 1)
    )
    return {
        "world": world,
        "row": row,
        "title": spec["title"],
        "layout": spec["layout"] or spec["tp"],
        "median_step_s": statistics.median(ranks[0]["step_times_s"]),
        "step_times_s": ranks[0]["step_times_s"],
        "final_loss": ranks[0]["losses"][-1],
        "comm_bytes_mean": comm,
        # How many times per step a rank gathered all of its weights: its all-gathered bytes over
        # its own parameter shard (all-gather bytes count the input shard), mean over ranks.
        "weights_gathered_per_step": statistics.mean(
            _gathered_bytes(r) / r["held_bytes"]["parameters"] for r in ranks
        ),
        "all_gather_bytes_mean": statistics.mean(_gathered_bytes(r) for r in ranks),
        "peak_bytes_max": mem,
        "peak_rss_bytes_max": max(r["peak_rss_bytes"] for r in ranks),
        "bubble_measured": bubble_fraction(pipelines.values()) if len(pipelines) > 1 else None,
        "cpu_share": cpu_share,
    }


def _gathered_bytes(rank: dict[str, Any]) -> int:
    """All-gathered bytes of one rank's counted step, over every mesh axis."""
    return sum(s["bytes"] for s in (rank["comm"] or {}).get("all_gather", {}).values())


def expectations(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's expected ratios against what was measured."""
    from lightning_zeropp.core import ZeroPPConfig
    from lightning_zeropp.core.measure.timeline import bubble_fraction
    from lightning_zeropp.core.schedule.zeropp import bubble_formula
    from lightning_zeropp.viz import planned_timelines

    lines = []
    for world in sorted({r["world"] for r in rows}):
        by = {r["row"]: r for r in rows if r["world"] == world}
        regather = by.get("1f1b_regather")
        keep = by.get("1f1b_keep")
        for name in ("zeropp_u1", "zeropp_u2"):
            z = by.get(name)
            if z is None:
                continue
            pp, v, u = z["layout"]["pp_size"], 2, z["layout"]["unit_size"]
            # The formula's baseline gathers every weight twice per micro-batch (forward and
            # backward): 2M times per step. The schedule also merges the last block of a unit with
            # the first of the next (both on chunk 0): one chunk gather fewer per unit boundary.
            want = (2 * v - 1) / (2 * v * u)
            n_units = -(-MICROBATCHES // u)
            merged = (n_units * (2 * v - 1) - (n_units - 1)) / (2 * v * MICROBATCHES)
            got = z["weights_gathered_per_step"] / (2 * MICROBATCHES)
            line = (
                f"world {world} {name}: gathered its weights {z['weights_gathered_per_step']:.2f} "
                f"times per step; / (2M = {2 * MICROBATCHES}) = {got:.3f}, against (2v-1)/(2vU) = "
                f"{want:.3f}, or {merged:.3f} counting the gathers shared across unit boundaries"
            )
            if regather:
                # Torch's PipelineStage reshards after backward only on the last micro-batch, so
                # the 1F1B re-gather row shares one gather between a backward and the next forward.
                line += (
                    f". The 1F1B re-gather row, as torch runs it, gathered "
                    f"{regather['weights_gathered_per_step']:.2f} times per step; all-gather "
                    f"bytes against it: "
                    f"{z['all_gather_bytes_mean'] / regather['all_gather_bytes_mean']:.3f}"
                )
            lines.append(line)
            if keep:
                got = z["peak_bytes_max"]["gathered_weights"] / max(
                    keep["peak_bytes_max"]["gathered_weights"], 1
                )
                lines.append(
                    f"world {world} {name}: peak gathered weights / no-reshard 1F1B = {got:.3f} "
                    f"(expected about 1/v = {1 / v:.3f})"
                )
            if z["bubble_measured"] is not None:
                config = ZeroPPConfig(**z["layout"]).resolve(world)
                planned = bubble_fraction(planned_timelines(config))
                lines.append(
                    f"world {world} {name}: bubble measured {z['bubble_measured']:.3f}; planned "
                    f"with the split (simulator, F:I:W = 1:1:1) {planned:.3f}; formula without "
                    f"the split {bubble_formula(pp, v, u):.3f}"
                )
            for other in by.values():
                if other is not z:
                    lines.append(
                        f"world {world} {name}: step time / {other['row']} = "
                        f"{z['median_step_s'] / other['median_step_s']:.2f}"
                    )
    return lines


CAVEATS = [
    "- 4 or 8 ranks share 2 cores: a rank waiting for a core counts as busy and one waiting for "
    "a message as idle, so the measured bubbles say little about the schedules (the simulator's "
    "planned bubble stands beside them), and gloo's all-gathers are memory copies: the step times "
    "compare CPU work and scheduling overhead, not what the layouts do on GPUs.",
    "- 'gathered weights' is the most FSDP-unsharded parameter memory alive at once; "
    "'activations' the most bytes saved for backward alive at once. ZeroPP trades the second for "
    "the first: a unit runs all its micro-batches through a chunk before the next, and held-back "
    "weight-gradient tasks keep their activations until the end of the unit.",
    "- The 1F1B re-gather row is torch's PipelineStage with reshard_after_forward=True: it "
    "reshards after backward only on the last micro-batch, so it gathers about M+1 times per "
    "step, not the 2M the issue's formula assumes; both comparisons are listed.",
    "- The TP row's tensor-parallel collectives go through functional collectives, which "
    "CommCounter does not see: its bytes miss the TP traffic. Its attention has separate q/k/v "
    "projections (same sizes) so heads stay whole per TP rank: a slightly different loss.",
]


def mib(n: float) -> str:
    return f"{n / MIB:.2f}"


def write_markdown(meta: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    m = meta["machine"]
    out = [
        "# ZeroPP against other layouts (CPU gloo)",
        "",
        f"{m['date']}, commit {m['commit']}, {m['cpu']} ({m['cores']} cores), torch {m['torch']}.",
        f"GPT {meta['model']}, global batch {meta['global_batch']}, {MICROBATCHES} micro-batches "
        f"per pipeline, AdamW, fp32; {meta['steps']} timed steps after {meta['warmup']} warm-up; "
        f"run took {meta['wall_s']} s. `python bench/bench_zeropp.py`.",
        "",
        "Bytes are per rank and step (mean over ranks); memory is the max over ranks (MiB).",
        "CPU share: the ranks' CPU time per core-second of wall time over the timed steps "
        "(near 1 = the cores were the run's own).",
        "",
        "| world | row | median step (s) | all-gather MiB | all bytes MiB | params | grads | "
        "optim | gathered weights | activations | bubble | loss | CPU share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem = r["peak_bytes_max"]
        bubble = "" if r["bubble_measured"] is None else f"{r['bubble_measured']:.3f}"
        out.append(
            f"| {r['world']} | {r['title']} | {r['median_step_s']:.3f} | "
            f"{mib(r['all_gather_bytes_mean'])} | {mib(sum(r['comm_bytes_mean'].values()))} | "
            f"{mib(mem['parameters'])} | {mib(mem['gradients'])} | {mib(mem['optimizer_state'])} | "
            f"{mib(mem['gathered_weights'])} | {mib(mem['activations'])} | {bubble} | "
            f"{r['final_loss']:.4f} | {r['cpu_share']:.2f} |"
        )
    out += ["", "## Against the expectations", ""] + [f"- {line}" for line in meta["expect"]]
    out += ["", "## Reading it", "", *CAVEATS]
    out += ["", "## Traffic per kind and axis (MiB per rank and step, mean over ranks)", ""]
    for r in rows:
        parts = ", ".join(f"{k} {mib(v)}" for k, v in sorted(r["comm_bytes_mean"].items()))
        out.append(f"- world {r['world']} {r['title']}: {parts}")
    path.write_text("\n".join(out) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="4,8")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rows", default=",".join(rows_for(4)))
    parser.add_argument("--worker")
    parser.add_argument("--out")
    parser.add_argument("--world", type=int)
    args = parser.parse_args()
    if args.worker:
        run_rank(args.worker, args.world, args.steps, args.warmup, Path(args.out))
        return
    start = time.monotonic()
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        for name in args.rows.split(","):
            t0 = time.monotonic()
            worker_args = ["--world", str(world), "--steps", str(args.steps)]
            worker_args += ["--warmup", str(args.warmup)]
            timeout = row_timeout_s(world, args.steps, args.warmup)
            ranks = launch_ranks(__file__, name, world, worker_args, timeout)
            rows.append(summarize(world, name, ranks))
            print(
                f"world {world} {name}: median step {rows[-1]['median_step_s']:.3f}s "
                f"({time.monotonic() - t0:.0f}s)",
                flush=True,
            )
    meta = {
        "machine": machine(),
        "model": MODEL,
        "global_batch": GLOBAL_BATCH,
        "steps": args.steps,
        "warmup": args.warmup,
        "wall_s": round(time.monotonic() - start, 1),
        "expect": expectations(rows),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "zeropp.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    write_markdown(meta, rows, RESULTS / "zeropp.md")
    print("\n".join(meta["expect"]))


if __name__ == "__main__":
    main()
