"""Stages cut by parameters ("even", the old default) against stages cut by cost ("balanced").

    python bench/bench_cost_cut.py [--pp 4,8] [--scale 4] [--steps 2] [--warmup 1] [--planner-only]

Writes bench/results/cost_cut.md and cost_cut.json (machine, date, commit; `--out-name` names
them otherwise).

1. The planner (`plan.predict_step_time`, H100 figures of conf/cluster/h100_1x8.yaml, bf16, 4096
   tokens a row): Llama-3-8B, Llama-2-70B and Gemma-2-9B shapes, pp 4 (x dp_shard 2) and pp 8,
   1F1B and ZeroPP (v 2, U = pp), 4 pp micro-batches: each cut's split points, the busiest
   rank's share of the FLOPs, and the predicted step.
2. The emulated device (`emulated_device.py`, no network namespaces: every rank on the machine's
   loopback, whose tiny messages cost next to nothing): the Llama-3-8B shape at 4096 tokens, a
   pipeline of pp ranks (no data parallelism), 2 pp micro-batches. A stand-in GPT of 32 blocks
   (dimension 64, 64 tokens) whose every block costs, as a timed wait, what the planner's FLOPs
   of one Llama-3-8B block take on an H100 at 45% of its bf16 peak, and whose head costs what
   the 8B's head and loss take (forward F, input gradient I = F, weight gradient W = F), slowed
   `--scale` times. The engine runs with the 8B's even and balanced split points, and the
   balanced ones with the head and the loss in chunks ("chunked": its backward computes the
   logits again, and its input pass computes the weight's gradient too, so the head costs I = 3F
   and W = 0); measured: the median step (barrier to the last rank's device done); planned: the
   planner told the same per-unit seconds.
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
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's library
from common import launch_ranks, machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
SEQ = 4096
MODELS = ("llama3_8b", "llama_70b", "gemma2_9b")
PEAK, EFFICIENCY = 989e12, 0.45  # H100 SXM bf16 dense; share sustained (the planner's range)
STANDIN = {"vocab_size": 64, "seq_len": 64, "dim": 64, "num_heads": 2, "num_layers": 32}
PG_TIMEOUT = datetime.timedelta(seconds=600)


def build(name: str) -> Any:
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={name}"])
    with torch.device("meta"):
        return instantiate(cfg.model.net)


def layout(schedule: str, pp: int, world: int, per_rank: int = 4) -> dict[str, Any]:
    """pp x dp_shard, `per_rank` x pp micro-batches."""
    out: dict[str, Any] = {
        "pp_size": pp, "dp_shard_size": world // pp, "num_microbatches": per_rank * pp,
    }  # fmt: skip
    if schedule == "zeropp":
        out.update(schedule="zeropp", num_chunks=2, unit_size=pp)
    else:
        out["schedule"] = schedule
    return out


# ---------------------------------------------------------------------------------- planner
def planner_rows(pps: list[int]) -> list[dict[str, Any]]:
    import yaml

    from lightning_zeropp.core import ZeroPPConfig
    from lightning_zeropp.plan import Hardware, predict_step_time
    from lightning_zeropp.plan.cut import busiest_share, piece_costs, with_cut

    cluster = yaml.safe_load((ROOT / "conf" / "cluster" / "h100_1x8.yaml").read_text())
    hardware, world = Hardware.from_cluster(cluster, "bf16"), 8
    rows = []
    for name in MODELS:
        model = build(name)
        head = piece_costs(model, SEQ, False).head_in_blocks()
        for pp in pps:
            for schedule in ("1f1b", "zeropp"):
                base = {**layout(schedule, pp, world), "param_dtype": "bf16"}
                rows_per_rank = base["num_microbatches"]  # one row a micro-batch
                row: dict[str, Any] = {"model": name, "pp": pp, "schedule": schedule,
                                       "head_blocks": head}  # fmt: skip
                for cut in ("even", "balanced"):
                    settings = with_cut(model, base, SEQ, cut, world)
                    plan = predict_step_time(
                        model, ZeroPPConfig(**settings), world, rows_per_rank * (world // pp),
                        SEQ, hardware,
                    )  # fmt: skip
                    row[cut] = {
                        "split_points": settings["split_points"],
                        "busiest_share": busiest_share(model, settings, SEQ, world),
                        "step_s": plan.step_s,
                        "bubble": plan.bubble,
                    }
                row["gain"] = row["even"]["step_s"] / row["balanced"]["step_s"] - 1
                print(_planner_line(row), flush=True)
                rows.append(row)
    return rows


def _planner_line(r: dict[str, Any]) -> str:
    e, b = r["even"], r["balanced"]
    return (
        f"| {r['model']} | {r['head_blocks']:.1f} | pp {r['pp']} {r['schedule']} | "
        f"{e['split_points']} | {e['busiest_share']:.1%} | {e['step_s']:.3f} | "
        f"{b['split_points']} | {b['busiest_share']:.1%} | {b['step_s']:.3f} | {r['gain']:+.1%} |"
    )


# ---------------------------------------------------------------------------------- emulated
def seconds(scale: float) -> dict[str, float]:
    """Forward seconds of one Llama-3-8B block and of its head + loss, on the emulated device."""
    from lightning_zeropp.plan.cut import piece_costs

    costs = piece_costs(build("llama3_8b"), SEQ, False)
    rate = PEAK * EFFICIENCY / scale
    return {"block_s": costs.blocks[0] / 3 / rate, "head_s": costs.after / 3 / rate}


def standin() -> Any:
    from torch import nn

    from lightning_zeropp.models import GPT, GPTConfig

    model = GPT(GPTConfig(**STANDIN))
    model.head = nn.Sequential(model.head)  # a module with a parameter-holding child: emulable
    return model


def head_cost(head_s: float, chunked: bool) -> tuple[float, float, float]:
    """The head and the loss's forward, input-gradient and weight-gradient seconds: whole logits
    (F, F, F), or in chunks (F, 3F, 0: the logits again, the hidden states' and the weight's
    gradients, all in the input pass, which keeps the weight's for the weight pass)."""
    return (head_s, 3 * head_s, 0.0) if chunked else (head_s, head_s, head_s)


def run_rank(
    row: str, steps: int, warmup: int, block_s: float, head_s: float, out: Path, chunked: bool
) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from emulated_device import BlockCost, EmulatedDevice, emulate_blocks, install

    from lightning_zeropp import launch_layout
    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    schedule, pp, points = _row(row)
    config = ZeroPPConfig(**layout(schedule, pp, pp, 2), split_points=points).resolve(pp)
    torch.manual_seed(0)
    model = standin()
    device = EmulatedDevice()
    block = BlockCost(block_s, block_s, block_s)
    emulate_blocks(
        [*model.blocks, model.head],
        [block] * 32 + [BlockCost(*head_cost(head_s, chunked))],
        device,
    )
    example = (torch.zeros(1, STANDIN["seq_len"], dtype=torch.long),)
    engine = ZeroPPEngine(
        model, launch_layout(config), split="stack", example_args=example,
        loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (config.num_microbatches, STANDIN["seq_len"] + 1), generator=gen)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    records = []
    with install(device):
        for i in range(warmup + steps):
            device.sync()
            dist.barrier()
            start = time.perf_counter()
            engine.train_step(x, target=y)
            device.sync()
            if i >= warmup:
                records.append({"start": start, "end": time.perf_counter()})
            for p in engine.parameters():
                p.grad = None
    rank = dist.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "steps": records}))
    dist.barrier()
    os._exit(0)  # as bench_emulated: the figures are written


def _row(row: str) -> tuple[str, int, list[int]]:
    """`<schedule>@pp<n>@<points, dash-separated>`."""
    schedule, pp, points = row.split("@")
    return schedule, int(pp[2:]), [int(p) for p in points.split("-")]


def planned(row: str, block_s: float, head_s: float, chunked: bool = False) -> float:
    import torch

    from lightning_zeropp.core import ZeroPPConfig
    from lightning_zeropp.plan import Hardware, predict_step_time
    from lightning_zeropp.plan.memory import stage_ranges

    schedule, pp, points = _row(row)
    with torch.device("meta"):
        model = standin()
        for b in [*model.blocks, model.head]:  # the emulated device's one-element weight path
            b.register_parameter("emulated_weight", torch.nn.Parameter(torch.zeros(1)))
    # a chunk below the stand-in's 64 tokens: the planner prices the head as chunked (its weight
    # gradient in the input pass), with the seconds given below
    chunk = 16 if chunked else 0
    config = ZeroPPConfig(**layout(schedule, pp, pp, 2), split_points=points, loss_chunk=chunk)
    cfg = config.resolve(pp)
    ranges = stage_ranges(model, cfg)
    units = [
        [(head_s, sum(head_cost(head_s, chunked)[1:])) if s == len(ranges) - 1 else (0.0, 0.0)]
        + [(block_s, 2 * block_s)] * len(r)
        for s, r in enumerate(ranges)
    ]
    hw = Hardware(flops_per_s=1.0, intra_node_Bps=1e9, inter_node_Bps=1e9, node_size=pp,
                  latency_s=1e-4, overlap=True, rings=1)  # fmt: skip
    plan = predict_step_time(
        model, config, pp, cfg.num_microbatches, STANDIN["seq_len"], hw, unit_seconds=units,
        optimizer_seconds=0.0,
    )  # fmt: skip
    return plan.step_s


def emulated_rows(
    pps: list[int], planner: list[dict[str, Any]], args: Any, meta: dict[str, Any]
) -> list[dict]:
    s = seconds(args.scale)
    print(f"block forward {s['block_s'] * 1e3:.1f} ms, head + loss {s['head_s'] * 1e3:.1f} ms "
          f"(scale {args.scale})", flush=True)  # fmt: skip
    out = []
    for r in planner:
        if r["model"] != "llama3_8b" or r["pp"] not in pps:
            continue
        got: dict[str, Any] = {"pp": r["pp"], "schedule": r["schedule"], **s}
        for cut in ("even", "balanced", "chunked"):
            chunked = cut == "chunked"
            split_points = r["balanced" if chunked else cut]["split_points"]
            points = "-".join(map(str, split_points))
            row = f"{r['schedule']}@pp{r['pp']}@{points}"
            extra = ["--steps", str(args.steps), "--warmup", str(args.warmup),
                     "--block", str(s["block_s"]), "--head", str(s["head_s"]),
                     *(["--chunked"] if chunked else [])]  # fmt: skip
            t0, load = time.monotonic(), os.getloadavg()[0]
            ranks = launch_ranks(__file__, row, r["pp"], extra, 1500.0)
            steps = [
                max(k["steps"][i]["end"] for k in ranks)
                - min(k["steps"][i]["start"] for k in ranks)
                for i in range(len(ranks[0]["steps"]))
            ]
            got[cut] = {"split_points": split_points, "steps_s": steps,
                        "step_s": statistics.median(steps),
                        "planned_s": planned(row, **_bh(s), chunked=chunked),
                        "load_1m": [load, os.getloadavg()[0]],
                        "wall_s": time.monotonic() - t0}  # fmt: skip
            print(f"{row}{' chunked' if chunked else ''}: step {got[cut]['step_s']:.2f} s "
                  f"(planned {got[cut]['planned_s']:.2f}) [load {load:.1f}]", flush=True)  # fmt: skip
        got["gain"] = got["even"]["step_s"] / got["balanced"]["step_s"] - 1
        got["gain_chunked"] = got["even"]["step_s"] / got["chunked"]["step_s"] - 1
        out.append(got)
        write(meta, planner, out)  # after every row: a run stopped early keeps what it measured
    return out


def _bh(s: dict[str, float]) -> dict[str, float]:
    return {"block_s": s["block_s"], "head_s": s["head_s"]}


def write(meta: dict[str, Any], planner: list[dict], emulated: list[dict]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {**meta, "planner": planner, "emulated": emulated}
    (RESULTS / f"{meta['out_name']}.json").write_text(json.dumps(data, indent=1))
    m = meta["machine"]
    lines = [
        "# Stages cut by cost against stages cut by parameters",
        "",
        f"`python bench/bench_cost_cut.py {' '.join(meta['argv'])}` on {m['cpu']} "
        f"({m['cores']} cores, load {m['load_average_1m_at_start']:.1f} at start), {m['date']}, "
        f"torch {m['torch']}, commit {m['commit']}. Sequence {SEQ} tokens a row.",
        "",
        "## The planner (H100 figures of conf/cluster/h100_1x8.yaml, bf16, world 8)",
        "",
        "Predicted step of one layout under each cut: pp 4 x dp_shard 2 or pp 8, 4 pp "
        "micro-batches of one row, ZeroPP with v 2, U = pp. `head`: the head and loss's FLOPs "
        "in decoder blocks; `busiest`: the busiest pipeline rank's share of the FLOPs.",
        "",
        "| model | head (blocks) | layout | even split | busiest | step (s) | balanced split "
        "| busiest | step (s) | faster |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *[_planner_line(r) for r in planner],
    ]
    if emulated:
        lines += [
            "",
            "## The emulated device (Llama-3-8B shape, 4096 tokens)",
            "",
            f"Block forward {emulated[0]['block_s'] * 1e3:.1f} ms, head + loss "
            f"{emulated[0]['head_s'] * 1e3:.1f} ms (H100 at {EFFICIENCY:.0%} of bf16 peak, "
            f"slowed {meta['scale']}x); pp ranks, 2 pp micro-batches, median of "
            f"{meta['steps']} steps after {meta['warmup']} warm-up.",
            "",
            "Steps: median [fastest] of the timed steps (a loaded machine only adds delay: the "
            "host falls behind its emulated device); load: the 1-minute load average before and "
            "after the row.",
            "",
            "| layout | even step (s) | planned | load | balanced step (s) | planned | load "
            "| faster (median) | faster (fastest) | faster (planned) "
            "| balanced + chunked step (s) | planned | load | faster than even (median) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in emulated:
            e, b, c = r["even"], r["balanced"], r.get("chunked")
            fastest = min(e["steps_s"]) / min(b["steps_s"]) - 1
            chunked = (
                f"{c['step_s']:.2f} [{min(c['steps_s']):.2f}] | {c['planned_s']:.2f} | "
                f"{_load(c)} | {r['gain_chunked']:+.1%}"
                if c
                else "- | - | - | -"
            )
            lines.append(
                f"| pp {r['pp']} {r['schedule']} | {e['step_s']:.2f} [{min(e['steps_s']):.2f}] | "
                f"{e['planned_s']:.2f} | {_load(e)} | {b['step_s']:.2f} [{min(b['steps_s']):.2f}] "
                f"| {b['planned_s']:.2f} | {_load(b)} | {r['gain']:+.1%} | {fastest:+.1%} | "
                f"{e['planned_s'] / b['planned_s'] - 1:+.1%} | {chunked} |"
            )
    (RESULTS / f"{meta['out_name']}.md").write_text("\n".join(lines) + "\n")


def _load(row: dict[str, Any]) -> str:
    return "-".join(f"{x:.0f}" for x in row["load_1m"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--pp", default="4,8")
    parser.add_argument("--scale", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--planner-only", action="store_true")
    parser.add_argument("--out-name", default="cost_cut", help="results file names")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--block", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--head", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--chunked", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_rank(
            args.worker, args.steps, args.warmup, args.block, args.head, Path(args.out),
            args.chunked,
        )  # fmt: skip
        return
    pps = [int(p) for p in args.pp.split(",")]
    meta = {"machine": machine(), "argv": sys.argv[1:], "scale": args.scale,
            "steps": args.steps, "warmup": args.warmup, "out_name": args.out_name}  # fmt: skip
    planner = planner_rows(pps)
    write(meta, planner, [])
    emulated = [] if args.planner_only else emulated_rows(pps, planner, args, meta)
    write(meta, planner, emulated)
    print((RESULTS / f"{meta['out_name']}.md").read_text())


if __name__ == "__main__":
    main()
