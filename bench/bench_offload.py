"""Activation offload: peak activation memory per pipeline rank with and without offload.

    python bench/bench_offload.py [--pp 4,8] [--skip-measured]

Writes bench/results/offload.md and offload.json (machine, date, commit).

1. The planner (`plan.activation_peaks`, `plan.host_activation_peaks`, `plan.predict_step_time`;
   H100 figures of conf/cluster/h100_1x8.yaml, its host link 50 GB/s, bf16): the Llama-3-8B
   shape at 4096 tokens a row, one row a micro-batch, pp 4 (x dp_shard 2) and pp 8, 1F1B and
   ZeroPP (v 2, U = pp), 4 pp micro-batches, cut by cost: each pipeline rank's device-resident
   activation peak with offload off, "auto" and "on", what "auto" holds on the host, and the
   predicted step of each.
2. Measured on this machine (4 gloo ranks, CPU): the bundled GPT (8 blocks, dim 64, 256 tokens),
   pp 4 1F1B, 8 micro-batches: the memory report's activation peak per rank (the device's
   share: on CPU device and host are one memory, so what is measured is the accounting) and
   what the offload hooks held on the host, with offload off and "auto"; losses equal bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's library
from common import launch_ranks, machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
SEQ = 4096
GIB = 2**30


def planner_rows(pps: list[int]) -> list[dict[str, Any]]:
    import yaml
    from bench_cost_cut import build, layout

    from lightning_zeropp.core import ZeroPPConfig
    from lightning_zeropp.plan import Hardware, predict_step_time
    from lightning_zeropp.plan.activations import activation_peaks, host_activation_peaks
    from lightning_zeropp.plan.cut import with_cut

    cluster = yaml.safe_load((ROOT / "conf" / "cluster" / "h100_1x8.yaml").read_text())
    hardware, world = Hardware.from_cluster(cluster, "bf16"), 8
    model = build("llama3_8b")
    rows = []
    for pp in pps:
        for schedule in ("1f1b", "zeropp"):
            base = with_cut(
                model,
                {**layout(schedule, pp, world), "param_dtype": "bf16"},
                SEQ,
                "balanced",
                world,
            )
            batch = base["num_microbatches"] * (world // pp)
            row: dict[str, Any] = {"pp": pp, "schedule": schedule}
            for policy in ("off", "auto", "on"):
                cfg = ZeroPPConfig(**base, offload_activations=policy)
                row[policy] = {
                    "device": activation_peaks(model, cfg, world, batch, SEQ),
                    "host": host_activation_peaks(model, cfg, world, batch, SEQ),
                    "step_s": predict_step_time(model, cfg, world, batch, SEQ, hardware).step_s,
                    "ranks": cfg.resolve(world).offload_ranks(),
                }
            print(json.dumps({k: row[k] for k in ("pp", "schedule")}), flush=True)
            rows.append(row)
    return rows


def run_rank(out: Path) -> None:
    import torch
    import torch.distributed as dist

    from lightning_zeropp import launch_layout
    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
    from lightning_zeropp.models import GPT, GPTConfig

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    result = {}
    for policy in ("off", "auto"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, seq_len=256, dim=64, num_heads=2, num_layers=8))
        config = ZeroPPConfig(pp_size=4, num_microbatches=8, offload_activations=policy)
        x = torch.randint(0, 256, (16, 256), generator=torch.Generator().manual_seed(1))

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

        engine = ZeroPPEngine(model, launch_layout(config), loss_fn=loss_fn, example_args=(x[:2],))
        loss = engine.train_step(x, target=x.roll(-1, 1))
        result[policy] = {
            "loss": loss.item(),
            "device": engine.activation_peak,
            "host": engine.host_activation_peak,
            "pp_rank": engine.dims.pp_rank,
            "copies": None if engine.offload is None else engine.offload.storages,
            "saved": None if engine.offload is None else engine.offload.tensors,
        }
    rank = dist.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _gib(n: int | None) -> str:
    return "-" if not n else f"{n / GIB:.2f}"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def report(info: dict[str, Any], planned: list[dict[str, Any]], measured: list[Any]) -> str:
    lines = [
        "# Activation offload: peak activations per pipeline rank",
        "",
        f"Machine: {info['cpu']} ({info['cores']} cores, load {info['load_average_1m_at_start']:.1f}"
        f" at start), torch {info['torch']}, {info['date']}, commit {info['commit']}.",
        "Written by `python bench/bench_offload.py`.",
        "",
        "## Planned: Llama-3-8B shape, 4096 tokens a row, H100 (conf/cluster/h100_1x8.yaml)",
        "",
        "Device-resident activation peak per pipeline rank (GiB), bf16, cut by cost, 4 pp "
        "micro-batches of one row; `auto` offloads the ranks holding more micro-batches in "
        "flight than the mean; host: what `auto` holds in host memory; step: predicted, with the "
        "copies over a 50 GB/s host link (the copy back prefetched where the backward is one "
        "task, 1F1B; copied back as read, in I and in W, where it is split, ZeroPP).",
        "",
        "| layout | offload | ranks offloading | device peak per rank (GiB) | host (auto) | step s |",
        "|---|---|---|---|---|---|",
    ]
    for row in planned:
        for policy in ("off", "auto", "on"):
            r = row[policy]
            device = " / ".join(_gib(r["device"][k]) for k in sorted(r["device"]))
            host = " / ".join(_gib(r["host"][k]) for k in sorted(r["host"]))
            lines.append(
                f"| pp {row['pp']} {row['schedule']} | {policy} | {r['ranks']} | {device} | "
                f"{host if policy != 'off' else '-'} | {r['step_s']:.3f} |"
            )
    if measured:
        lines += [
            "",
            "## Measured: bundled GPT on 4 gloo ranks (CPU), pp 4 1F1B, 8 micro-batches",
            "",
            "The memory report's activation peak (the device's share, MiB) and what the offload "
            "hooks held on the host; on CPU both are one memory: this checks the accounting. "
            "Host copies: one per storage and stage forward, against the saved tensors they "
            "serve.",
            "",
            "| pp rank | off: device | auto: device | auto: host | host copies / saved tensors "
            "| losses equal |",
            "|---|---|---|---|---|---|",
        ]
        for m in sorted(measured, key=lambda m: m["off"]["pp_rank"]):
            lines.append(
                f"| {m['off']['pp_rank']} | {_mib(m['off']['device'])} | "
                f"{_mib(m['auto']['device'])} | {_mib(m['auto']['host'])} | "
                f"{m['auto'].get('copies') or '-'} / {m['auto'].get('saved') or '-'} | "
                f"{m['off']['loss'] == m['auto']['loss']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", default="4,8")
    parser.add_argument("--skip-measured", action="store_true")
    parser.add_argument("--worker")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        run_rank(Path(args.out))
        return
    info = machine()
    planned = planner_rows([int(p) for p in args.pp.split(",")])
    measured = [] if args.skip_measured else launch_ranks(__file__, "gpt", 4, [], 600)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "offload.json").write_text(
        json.dumps({"machine": info, "planned": planned, "measured": measured}, indent=1)
    )
    text = report(info, planned, measured)
    (RESULTS / "offload.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
