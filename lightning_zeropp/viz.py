"""Pictures of a ZeroPP schedule: planned actions and a measured run, as Gantt charts and a trace.

    python -m lightning_zeropp.viz --pp 2 --chunks 2 --microbatches 8 --unit-size 4 --out schedule/

writes, from one command:
- `planned.png`: each pipeline rank's planned actions from the schedule generator, timed by the
  dependency simulator (forward 1, input grad 1, weight grad 1, full backward 2 time units), with a
  lane for gathers (UNSHARD), releases (RESHARD), sends, receives and early reduce-scatters;
- `measured.png` and `trace.json`: a real step of the bundled GPT on CPU gloo ranks (pp x
  dp_shard processes), recorded by `core.measure.timeline.StepRecorder`; open the trace in
  chrome://tracing or https://ui.perfetto.dev (one process per rank, compute and comm threads);
- the bubble fractions (planned, the design's formula, measured) on stdout and in `summary.json`.

Needs matplotlib (`pip install lightning-zeropp[viz]`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

from lightning_zeropp.core.measure.timeline import Interval, Timeline, bubble_fraction
from lightning_zeropp.core.schedule.build import zeropp_orders, zeropp_plans
from lightning_zeropp.core.schedule.zeropp import DURATIONS, bubble_formula, simulate
from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.settings.layout import ZeroPPLayout

__all__ = ["planned_timelines", "draw_gantt", "write_chrome_trace", "main"]

COLORS = {
    "F": "#4c78a8",
    "B": "#e45756",
    "I": "#f58518",
    "W": "#54a24b",
    "all_gather": "#b279a2",
    "reduce_scatter": "#9d755d",
    "release": "#222222",
    "send": "#bab0ac",
    "recv": "#79706e",
    "send_recv": "#bab0ac",
    "all_reduce": "#eeca3b",
    "broadcast": "#72b7b2",
    "all_to_all": "#ff9da6",
    "barrier": "#dddddd",
}
GATHER, RELEASE, MARK = 0.3, 0.06, 0.04  # planned widths, in forward-task units


def planned_timelines(config: ZeroPPLayout) -> list[Timeline]:
    """Each pipeline rank's planned actions (a resolved `schedule="zeropp"` config): the lowered
    plans the runtime runs (`core.schedule.build.zeropp_plans`), timed by the schedule simulator."""
    orders = zeropp_orders(config)
    sim = simulate(orders, config.num_stages, config.num_microbatches, DURATIONS)
    timelines = []
    for rank, plan in zeropp_plans(config).items():
        tl = Timeline(rank=rank)
        times = iter(sim[rank])
        computed = [next(times)[1:] if step.kind == "compute" else None for step in plan]
        for i, step in enumerate(plan):
            if step.kind == "compute":
                assert step.task is not None
                span = computed[i]
                assert span is not None  # computed for every compute step
                start, end = span
                tl.intervals.append(
                    Interval(
                        "compute", step.task.kind, start, end, step.stage, step.task.microbatch
                    )
                )
                if step.task.kind in "FIB":  # activations / gradients go downstream
                    tl.intervals.append(Interval("comm", "send", end, end + MARK, step.stage))
            elif step.kind == "gather":  # just before the block's first task
                start = next(c for c in computed[i:] if c is not None)[0]
                tl.intervals.append(
                    Interval("comm", "all_gather", start - GATHER, start, step.stage)
                )
            else:  # a release or an early reduce-scatter: right after the task before it
                end = next(c for c in reversed(computed[:i]) if c is not None)[1]
                kind, width = (
                    ("release", RELEASE) if step.kind == "release" else ("reduce_scatter", GATHER)
                )
                tl.intervals.append(Interval("comm", kind, end, end + width, step.stage))
        timelines.append(tl)
    return timelines


def draw_gantt(timelines: list[Timeline], path: Path, title: str, unit: str = "s") -> None:
    """One compute row and one comm row per rank; bars labelled stage/micro-batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = max(t.end() for t in timelines) or 1.0
    fig, ax = plt.subplots(
        figsize=(max(10, min(40, span * 0.6 if unit == "t" else 14)), 1.2 * len(timelines) + 1.5)
    )
    labels, ticks = [], []
    for row, tl in enumerate(sorted(timelines, key=lambda t: t.rank)):
        base = (len(timelines) - 1 - row) * 2.4
        for i in tl.intervals:
            y = base + (1.0 if i.lane == "compute" else 0.0)
            height = 0.9 if i.lane == "compute" else 0.5
            ax.broken_barh(
                [(i.start, max(i.end - i.start, span * 1e-4))],
                (y, height),
                facecolors=COLORS.get(i.kind, "#cccccc"),
                edgecolor="white" if i.lane == "compute" else "none",
                linewidth=0.3,
            )
            if i.lane == "compute" and (i.end - i.start) > span / 120:
                ax.text(
                    (i.start + i.end) / 2, y + 0.45, f"{i.stage}.{i.microbatch}",
                    ha="center", va="center", fontsize=5, color="white",
                )  # fmt: skip
        ticks += [base + 0.25, base + 1.45]
        labels += [f"rank {tl.rank} comm", f"rank {tl.rank} compute"]
    ax.set_yticks(ticks, labels)
    ax.set_xlabel("time units (forward = 1)" if unit == "t" else "seconds")
    ax.set_title(title)
    order = list(COLORS)
    kinds = sorted(
        {i.kind for t in timelines for i in t.intervals},
        key=lambda k: order.index(k) if k in order else len(order),
    )
    ax.legend(
        handles=[Patch(color=COLORS.get(k, "#cccccc"), label=k) for k in kinds],
        loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(kinds), fontsize=8,
    )  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_chrome_trace(timelines: list[Timeline], path: Path) -> None:
    """Chrome trace-event JSON: process = rank, thread 0 = compute, thread 1 = comm."""
    events: list[dict[str, Any]] = []
    for tl in timelines:
        events.append(
            {"ph": "M", "name": "process_name", "pid": tl.rank, "args": {"name": f"rank {tl.rank}"}}
        )
        for tid, lane in enumerate(("compute", "comm")):
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": tl.rank,
                    "tid": tid,
                    "args": {"name": lane},
                }
            )
        for i in tl.intervals:
            name = (
                f"{i.stage}{i.kind}{i.microbatch}" if i.lane == "compute" else f"{i.kind} {i.axis}"
            )
            events.append({
                "ph": "X", "name": name, "cat": i.lane, "pid": tl.rank,
                "tid": 0 if i.lane == "compute" else 1,
                "ts": i.start * 1e6, "dur": max(i.end - i.start, 0.0) * 1e6,
                "args": {"stage": i.stage, "microbatch": i.microbatch, "axis": i.axis, "bytes": i.nbytes},
            })  # fmt: skip
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


# ------------------------------------------------------------------------------ measured run
def _measured_rank(rank: int, world: int, port: int, layout: dict[str, Any], out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_zeropp.core.engine import ZeroPPEngine
    from lightning_zeropp.core.measure.timeline import StepRecorder
    from lightning_zeropp.models import GPT, GPTConfig, TokenDataset

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        config = ZeroPPConfig(**layout).resolve(world)
        model_cfg = GPTConfig(num_layers=max(8, config.num_stages * 2))
        torch.manual_seed(0)
        model = GPT(model_cfg)
        m = config.num_microbatches
        assert m is not None
        data = TokenDataset.markov(2 * m * config.dp_size, model_cfg.seq_len, model_cfg.vocab_size)
        x = torch.stack([data[i][0] for i in range(len(data))])
        y = torch.stack([data[i][1] for i in range(len(data))])

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.flatten(0, 1), target.flatten())

        engine = ZeroPPEngine(model, config, loss_fn=loss_fn, example_args=(x[:2],))
        dp, per = engine.dims.dp_rank, 2 * m
        xb, yb = x[dp * per : (dp + 1) * per], y[dp * per : (dp + 1) * per]
        engine.train_step(xb, target=yb)  # first step: shape inference, not what we picture
        with StepRecorder(engine) as rec:
            engine.train_step(xb, target=yb)
        got: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(rec.timeline.to_dict(), got if rank == 0 else None, dst=0)
        if rank == 0:
            Path(out).write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def measured_timelines(config: ZeroPPLayout, layout: dict[str, Any]) -> list[Timeline]:
    """Run two steps on `pp x dp` CPU gloo processes; the second step's timeline of every rank."""
    import torch.multiprocessing as mp

    world = config.pp_size * config.dp_size
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "timelines.json")
        mp.spawn(_measured_rank, args=(world, port, layout, out), nprocs=world, join=True)
        return [Timeline.from_dict(d) for d in json.loads(Path(out).read_text())]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--unit-size", type=int, default=None)
    parser.add_argument("--dp-shard", type=int, default=1)
    parser.add_argument("--grad-reduce", default="step")
    parser.add_argument("--no-split-backward", action="store_true")
    parser.add_argument("--plan-only", action="store_true", help="skip the measured run")
    parser.add_argument("--out", type=Path, default=Path("schedule"))
    args = parser.parse_args(argv)
    layout = dict(
        schedule="zeropp",
        pp_size=args.pp,
        num_chunks=args.chunks,
        num_microbatches=args.microbatches,
        unit_size=args.unit_size,
        dp_shard_size=args.dp_shard,
        grad_reduce=args.grad_reduce,
        split_backward=not args.no_split_backward,
    )
    config = ZeroPPConfig(**layout).resolve(args.pp * args.dp_shard)
    assert config.unit_size is not None  # schedule="zeropp" resolves one
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"pp={config.pp_size} v={config.num_chunks} M={config.num_microbatches} U={config.unit_size}"
    planned = planned_timelines(config)
    draw_gantt(planned, args.out / "planned.png", f"ZeroPP planned: {name}", unit="t")
    summary: dict[str, Any] = {
        "layout": layout,
        "bubble_planned": bubble_fraction(planned),
        "bubble_formula_no_split": bubble_formula(
            config.pp_size,
            config.num_chunks,
            config.unit_size,
        ),
    }
    if not args.plan_only:
        measured = measured_timelines(config, layout)
        pipeline = [t for t in measured if t.rank < config.pp_size * config.dp_size]
        draw_gantt(pipeline, args.out / "measured.png", f"ZeroPP measured (CPU gloo): {name}")
        write_chrome_trace(measured, args.out / "trace.json")
        summary["bubble_measured"] = bubble_fraction(measured)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
