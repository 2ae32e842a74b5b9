"""Bytes sent across hosts per step, ranks numbered cyclically (SLURM's cyclic distribution over
two emulated hosts), with the mesh over the ranks as numbered (what the library did before it
read the hosts) and in host order (`core.hosts`).

Each emulated host is a UTS namespace (`tests/distributed/hosts_cluster.py`); bytes are counted
by the library's own accounting (`CommCounter` + `NodeTraffic` over the real hosts) in the third
step of the bundled tiny GPT, summed over the 4 ranks. Needs root.

    .venv/bin/python bench/bench_hosts.py   # writes bench/results/hosts.{json,md}, docs/img/hosts-cross-bytes.png

`--launchers`: time to first step per launcher on the two emulated hosts, each in its network
namespace (a veth link between them), pp 2 x dp_shard 2 on 2 x 2 ranks: the variables torchrun
or srun set (ranks started directly, cyclic numbering), torchrun's c10d rendezvous (an agent per
host) and `accelerate launch` (one per host). From the launch to the end of every rank's first
step (process start, imports, rendezvous, process group, the engine's setup, one step); each
run's 3 steps checked against one process. Writes bench/results/hosts_launchers.{json,md}.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.distributed.conftest import assert_matches_reference  # noqa: E402
from tests.distributed.elastic_cluster import run_agents  # noqa: E402
from tests.distributed.hosts_cluster import TwoLinks, launch_on_hosts, unavailable  # noqa: E402

CYCLIC = [0, 1, 0, 1]
LAYOUTS = {
    "pp 2 x dp_shard 2 (1F1B)": {
        "pp_size": 2, "dp_shard_size": 2, "schedule": "1f1b", "num_microbatches": 2,
    },
    "dp_replicate 2 x dp_shard 2 (HSDP)": {"dp_replicate_size": 2, "dp_shard_size": 2},
}  # fmt: skip


def main() -> None:
    if (why := unavailable()) is not None:
        raise SystemExit(f"cannot run: {why}")
    cases = []
    for name, layout in LAYOUTS.items():
        for numbered in (True, False):
            cases.append({"id": f"{name}|{numbered}", "layout": layout, "rank_numbered": numbered})
    with tempfile.TemporaryDirectory() as out:
        got = launch_on_hosts(CYCLIC, "hosts_scenarios.train", {"cases": cases}, Path(out), 900)
    rows = []
    for name in LAYOUTS:
        row = {"layout": name}
        for numbered, key in ((True, "as_numbered"), (False, "by_host")):
            case = f"{name}|{numbered}"
            row[key] = sum(r[case]["sent"]["cross_node"] for r in got)
            row[f"{key}_groups"] = got[0][case]["group_hosts"]
        rows.append(row)
    results = ROOT / "bench" / "results"
    (results / "hosts.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "| layout | shard groups' hosts, as numbered | as numbered (bytes/step) "
        "| shard groups' hosts, by host | by host (bytes/step) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['as_numbered_groups']} | {r['as_numbered']:,.0f} "
            f"| {r['by_host_groups']} | {r['by_host']:,.0f} |"
        )
    (results / "hosts.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _figure(rows, ROOT / "docs" / "img" / "hosts-cross-bytes.png")


def _figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    width, xs = 0.38, range(len(rows))
    ax.bar([x - width / 2 for x in xs], [r["as_numbered"] / 1e3 for r in rows], width,
           label="mesh over ranks as numbered")  # fmt: skip
    ax.bar([x + width / 2 for x in xs], [r["by_host"] / 1e3 for r in rows], width,
           label="mesh in host order")  # fmt: skip
    ax.set_xticks(list(xs), [r["layout"] for r in rows])
    ax.set_ylabel("kB sent across hosts per step")
    ax.set_title("Cyclic numbering over 2 hosts x 2 ranks (tiny GPT, all ranks)", fontsize=10)
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def launchers() -> None:
    if (why := unavailable()) is not None:
        raise SystemExit(f"cannot run: {why}")
    case = {"id": "run", "layout": LAYOUTS["pp 2 x dp_shard 2 (1F1B)"]}
    shapes = [
        ("torchrun's variables, ranks started directly", "cyclic", "direct", "torchrun"),
        ("srun's variables (one task per device)", "cyclic", "direct", "slurm"),
        ("torchrun, c10d rendezvous (an agent per host)", "by the rendezvous", "agents", "torchrun"),
        ("accelerate launch (one per host)", "by --machine_rank", "agents", "accelerate"),
    ]  # fmt: skip
    rows = []
    for name, numbering, how, launcher in shapes:
        with tempfile.TemporaryDirectory() as out, TwoLinks() as links:
            start = time.time()
            params = {"cases": [case]}
            if how == "direct":
                got = launch_on_hosts(CYCLIC, "hosts_scenarios.train", params, Path(out),
                                      600, links=links, launcher=launcher)  # fmt: skip
            else:
                codes = run_agents("hosts_scenarios.train", params, Path(out), nnodes="2",
                                   max_restarts=0, links=links, launcher=launcher)  # fmt: skip
                if codes != [0, 0]:
                    raise SystemExit(f"{name}: agents exited {codes}")
                got = [torch_load(Path(out) / f"result{r}.pt") for r in range(4)]
        try:
            assert_matches_reference(got, case)
            result = "equal to one process (1e-5)"
        except AssertionError as err:
            result = f"FAILED: {str(err).splitlines()[0]}"
        run = [r["run"] for r in got]
        rows.append({
            "launcher": name, "numbering": numbering,
            "hosts_by_rank": [r["host"] for r in run], "groups": run[0]["lines"][-2:],
            "first_step_s": max(r["first_step_done"] for r in run) - start, "result": result,
        })  # fmt: skip
        print(rows[-1], flush=True)
    results = ROOT / "bench" / "results"
    (results / "hosts_launchers.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "| launcher | ranks numbered | rank -> host | shard groups | time to first step | result |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        groups = "; ".join(g.strip().replace(" dp_shard groups: ranks", ":") for g in r["groups"])
        lines.append(f"| {r['launcher']} | {r['numbering']} | {r['hosts_by_rank']} | {groups} "
                     f"| {r['first_step_s']:.1f} s | {r['result']} |")  # fmt: skip
    load = os.getloadavg()[1]  # the times are mostly process start and imports: name the load
    lines += ["", f"Load average (5 min) at the end: {load:.1f} on {os.cpu_count()} cores."]
    (results / "hosts_launchers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def torch_load(path: Path) -> dict:
    import torch

    return torch.load(path, weights_only=False)


if __name__ == "__main__":
    launchers() if "--launchers" in sys.argv else main()
