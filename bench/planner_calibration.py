"""Calibration for bench_planner.py: what the step-time model is told about this machine, each
measured apart from the timed steps.

- `calibrate_rank`: 2 gloo ranks time trains of back-to-back all-gathers, reduce-scatters and
  send/recv per message size (receiver's time: a send returns once queued);
- `overhead_rank`: the engine's fixed cost per FSDP unit and task, on one rank at 8 tokens;
- `profile_stages`: each stage's forward and backward of one micro-batch on real tensors;
- `fit_line`: latency and bandwidth from the timed sizes;
- `published_table` (`python bench/planner_calibration.py --published`): the planner against the
  published H100 runs its cluster files' efficiency ranges come from; writes
  bench/results/planner_calibration.md.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any

MODEL = {"vocab_size": 256, "seq_len": 128, "dim": 256, "num_heads": 4, "num_layers": 8}
GLOBAL_BATCH = 16
PG_TIMEOUT = datetime.timedelta(seconds=120)
SIZES = [2**12, 2**14, 2**16, 2**18, 2**20, 2**22]  # calibration message bytes
TRAIN = 6  # calls timed back to back: a link's burst allowance does not pass for its rate
Layout = dict[str, Any]


def calibrate_rank(out: Path, sizes: list[int]) -> None:
    """Time gloo all-gather, reduce-scatter and send/recv between 2 ranks at each size."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    rank = dist.get_rank()
    times: dict[str, list[float]] = {"all_gather": [], "reduce_scatter": [], "p2p": []}
    for size in sizes:
        shard = torch.ones(size // 4)
        full = torch.empty(2 * shard.numel())
        for name, fn in (
            ("all_gather", lambda f=full, s=shard: dist.all_gather_into_tensor(f, s)),
            ("reduce_scatter", lambda f=full, s=shard: dist.reduce_scatter_tensor(s, f)),
            ("p2p", lambda s=shard: dist.send(s, 1) if rank == 0 else dist.recv(s, 0)),
        ):
            samples = []
            for _ in range(5):  # a train of back-to-back calls, as FSDP sends its units
                dist.barrier()
                start = time.perf_counter()
                for _ in range(TRAIN):
                    fn()
                samples.append((time.perf_counter() - start) / TRAIN)
            times[name].append(statistics.median(samples[1:]))
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "times": times}))
    dist.barrier()
    dist.destroy_process_group()


def overhead_rank(out: Path) -> None:
    """The engine's fixed cost per task, on one rank at a size where compute is small: a step of
    8 micro-batches minus a step of 1, less 7 bare forward+backward passes, per FSDP unit-task."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_zeropp import launch_layout
    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
    from lightning_zeropp.models import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    seq = 8
    tokens = torch.randint(0, MODEL["vocab_size"], (8, seq + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    steps = {}
    for m in (1, 8):
        torch.manual_seed(0)
        config = ZeroPPConfig(dp_shard_size=1, num_microbatches=m, reshard_after_forward=False)
        engine = ZeroPPEngine(
            GPT(GPTConfig(**MODEL)), launch_layout(config), split="stack",
            loss_fn=lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()),
        )  # fmt: skip
        rows = x[: m * 1], y[: m * 1]  # one row per micro-batch
        samples = []
        for _ in range(12):
            start = time.perf_counter()
            engine.train_step(rows[0], target=rows[1])
            samples.append(time.perf_counter() - start)
        steps[m] = statistics.median(samples[2:])
    model = GPT(GPTConfig(**MODEL))
    bare = []
    for _ in range(12):
        start = time.perf_counter()
        F.cross_entropy(model(x[:1]).flatten(0, 1), y[:1].flatten()).backward()
        bare.append(time.perf_counter() - start)
    per_pair = (steps[8] - steps[1]) / 7 - statistics.median(bare[2:])
    units = MODEL["num_layers"] + 1  # each block, and the root
    result = {"steps": steps, "bare": statistics.median(bare[2:]), "per_task_pair": per_pair,
              "unit_overhead_s": per_pair / (2 * units)}  # fmt: skip
    (out / "rank0.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def fit_line(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """seconds = latency + bytes / bandwidth: the bandwidth from the two largest messages (the
    sizes of the model's FSDP units), the latency from the smallest; returns (latency,
    bandwidth)."""
    bandwidth = (sizes[-1] - sizes[-2]) / max(seconds[-1] - seconds[-2], 1e-9)
    return max(seconds[0] - sizes[0] / bandwidth, 0.0), bandwidth


def profile_stages(world: int, layout: Layout) -> list[tuple[float, float]]:
    """Forward and backward seconds of one micro-batch per stage, on real tensors, one thread."""
    import torch
    import torch.nn.functional as F

    from lightning_zeropp.core import ZeroPPConfig
    from lightning_zeropp.models import GPT, GPTConfig
    from lightning_zeropp.plan.memory import split_stages

    config = ZeroPPConfig(**layout).resolve(world)
    torch.manual_seed(0)
    stages = split_stages(GPT(GPTConfig(**MODEL)), config)
    rows = GLOBAL_BATCH // config.dp_size // config.num_microbatches
    tokens = torch.randint(0, MODEL["vocab_size"], (rows, MODEL["seq_len"]))
    out, x = [], tokens
    for index, stage in enumerate(stages):
        fwd, bwd = [], []
        for _ in range(5):
            inp = x.detach().requires_grad_() if x.is_floating_point() else x
            start = time.perf_counter()
            y = stage(inp)
            loss = (
                F.cross_entropy(y.flatten(0, 1), tokens.flatten())
                if index == len(stages) - 1
                else None
            )
            mid = time.perf_counter()
            if loss is not None:
                loss.backward()
            else:
                y.backward(torch.ones_like(y))
            fwd.append(mid - start)
            bwd.append(time.perf_counter() - mid)
        out.append((statistics.median(fwd[1:]), statistics.median(bwd[1:])))
        x = y.detach()
    return out


# ------------------------------------------------------------------------ published runs
def published_table(cluster: str = "h100_4x8") -> list[dict[str, Any]]:
    """Each published run (`lightning_zeropp.plan.published`): its figure, the share of peak at
    which the planner predicts it, and the planner's range for it from the cluster file."""
    from pathlib import Path

    import yaml

    from lightning_zeropp.plan import Hardware
    from lightning_zeropp.plan.published import PUBLISHED, calibrate, predict

    conf = Path(__file__).resolve().parents[1] / "conf" / "cluster" / f"{cluster}.yaml"
    hw = Hardware.from_cluster(yaml.safe_load(conf.read_text()), "bf16")
    assert hw.efficiency is not None
    rows = []
    for run in PUBLISHED:
        low, high = hw.efficiency["compiled" if run.compiled else "eager"]
        rows.append({
            "name": run.name, "source": run.source, "metric": run.metric, "value": run.value,
            "compiled": run.compiled, "calibrates": run.calibrates, "note": run.note,
            "share": calibrate(run, hw, tolerance=1e-4),
            "range": [predict(run, hw, low), predict(run, hw, high)],
        })  # fmt: skip
    return rows


def write_published(rows: list[dict[str, Any]], path: Path) -> None:
    from common import machine

    m = machine()
    lines = [
        "# The planner against published H100 runs",
        "",
        f"- {m['date']}; commit {m['commit']}; computed on {m['cpu']}, {m['cores']} cores, load "
        f"average {m['load_average_1m_at_start']:.1f} (pure arithmetic: no figure here depends on "
        "the machine); `python bench/planner_calibration.py --published`",
        "- Share: the fraction of 989 TFLOP/s at which the planner predicts the run's published "
        "figure; range: the planner's prediction at the ends of conf/cluster/h100_4x8.yaml's "
        "efficiency range for the run's mode",
        "",
        "| Run | Mode | Published | Share | Planner's range | Inside | Approximations |",
        "|---|---|---:|---:|---|---|---|",
    ]
    for r in rows:
        fmt = (lambda v: f"{v:.1%}") if r["metric"] == "mfu" else (lambda v: f"{v:,.0f} tok/s")
        inside = r["range"][0] <= r["value"] <= r["range"][1]
        role = "yes" if inside else ("no (a check, not a source)" if not r["calibrates"] else "NO")
        lines.append(
            f"| {r['name']} | {'compiled' if r['compiled'] else 'eager'} | {fmt(r['value'])} | "
            f"{r['share']:.3f} | {fmt(r['range'][0])} - {fmt(r['range'][1])} | {role} | "
            f"{r['note']} |"
        )
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if "--published" not in sys.argv:
        raise SystemExit("usage: python bench/planner_calibration.py --published")
    results = Path(os.environ.get("BENCH_RESULTS", Path(__file__).resolve().parent / "results"))
    results.mkdir(parents=True, exist_ok=True)
    table = published_table()
    write_published(table, results / "planner_calibration.md")
    print((results / "planner_calibration.md").read_text())
