"""Faults and bad inputs, before and after: is every lost rank named on every survivor, does any
rank hang, does every new bad input get a clear error on every rank?

    .venv/bin/python bench/bench_faults.py                    # this checkout (about 15 minutes)
    .venv/bin/python bench/bench_faults.py --before 09864bb   # and an older commit, for 'before'
    .venv/bin/python bench/bench_faults.py --only lightning_step,lightning_partition

Writes `bench/results/faults.md` and `faults.json` (machine, date, commit). Each fault case of
`tests/distributed/fault_scenarios.py` runs on 4 fresh CPU ranks (pp 2 x dp_shard 2, a 20 s
process-group timeout): a rank killed (SIGKILL) or stopped (SIGSTOP) in setup, a training step,
a sync or async save, validation, Accelerate's prepare, save_state, gather_for_metrics or loss
weighting, rank 0 (the store's host) among them; and, where network namespaces can be made
(root, `bench/netns.py`), a partition: ranks 0-1 and 2-3 on two emulated nodes whose link is cut
in mid-training, in both fronts. A case counts as named when every survivor's error names the lost
rank (a partition: a rank of the other side) as lost; a rank hangs when it is still running 90 s
after the timeout would have fired.

Bad inputs are the attempts of `tests/distributed/error_scenarios.py` added in this round (each
run on 4 ranks, clear when every rank's error holds the message `test_bad_input.py` expects),
plus two that need a launcher: a busy MASTER_PORT under Lightning's own launch, and a torchrun
restart without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. An older tree runs the same cases (they use
public entry points only); what it lacks (a new error message) counts as not clear.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT  # noqa: E402
from faults_report import write  # noqa: E402

TIMEOUT_S = 20.0
HANG_AFTER_S = TIMEOUT_S + 90  # past the timeout and any naming: a hang
WORKER = Path(__file__).resolve().parent / "fault_worker.py"
# The bad inputs added in this round (tests/distributed/error_scenarios.py).
NEW_ATTEMPTS = [
    "lightning_split_points_differ_per_rank",
    "accelerate_split_points_differ_per_rank",
    "lightning_pp_size_differs_per_rank",
    "lightning_schedule_differs_per_rank",
    "accelerate_param_dtype_differs_per_rank",
    "accelerate_quantized_weights_differ_per_rank",
    "model_depth_differs_per_rank",
    "hsdp_replicas_built_unseeded",
    "lightning_ckpt_of_a_deeper_model",
    "lightning_ckpt_meta_runs_code",
    "lightning_ckpt_metadata_runs_code",
    "lightning_ckpt_changed_shard",
    "lightning_ckpt_truncated_shard",
    "lightning_ckpt_without_metadata",
    "lightning_ckpt_a_temporary",
    "load_from_a_deeper_model",
    "lightning_timeout_not_a_timedelta",
]


def _scenarios() -> Any:
    import importlib.util

    path = ROOT / "tests" / "distributed" / "fault_scenarios.py"
    spec = importlib.util.spec_from_file_location("fault_scenarios", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(tree: Path, mode: str, name: str, out: Path, victim: int = -1, cluster: Any = None):
    """4 ranks of `fault_worker.py`; returns (results by rank or None, hung ranks, cut time)."""
    out.mkdir(parents=True, exist_ok=True)
    port, procs = _free_port(), []
    for rank in range(4):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "4"}
        env |= {"LOCAL_WORLD_SIZE": "4", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        env |= {"MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
        prefix: list[str] = []
        if cluster is not None:  # its node's address and interface; ranks numbered as on one
            placed = cluster.env(rank)  # node (Lightning's devices=4 counts them so)
            env |= {k: placed[k] for k in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME")}
            prefix = cluster.command_prefix(rank)
        cmd = [*prefix, sys.executable, str(WORKER), str(tree), mode, name, str(out)]
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen([*cmd, str(TIMEOUT_S)], env=env, stdout=log, stderr=log))
    cut_at = None
    start = time.time()
    if cluster is not None:  # cut once every rank trains past step 2
        while not all((out / f"ready{r}").exists() for r in range(4)):
            if time.time() - start > 600 or any(p.poll() is not None for p in procs):
                break
            time.sleep(0.2)
        time.sleep(1.0)
        cut_at = time.time()
        cluster.cut(1)
    survivors = [p for r, p in enumerate(procs) if r != victim]
    while any(p.poll() is None for p in survivors):
        began = cut_at or _lost_at(out) or start
        if time.time() - began > HANG_AFTER_S + (0 if (cut_at or _lost_at(out)) else 600):
            break
        time.sleep(0.2)
    hung = [r for r, p in enumerate(procs) if r != victim and p.poll() is None]
    for p in procs:  # a stopped victim, hung ranks: ended here
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()
    results = {}
    for rank in range(4):
        file = out / f"result{rank}.pt"
        if file.exists():
            import torch

            results[rank] = torch.load(file, weights_only=False)
    return results, hung, cut_at


def _lost_at(out: Path) -> float | None:
    file = out / "lost_at"
    return float(file.read_text()) if file.exists() else None


def fault_case(tree: Path, case: str, spec: tuple, root: Path, cluster: Any = None) -> dict:
    _, victim, how, where = spec
    out = root / case
    results, hung, cut_at = run_job(tree, "case", case, out, victim, cluster)
    began = cut_at or _lost_at(out)
    rows = []
    for rank in range(4):
        if rank == victim:
            continue
        seen = results.get(rank, {})
        message = seen.get("message", "")
        if cluster is not None:  # the other side: 0-1 | 2-3
            other = [2, 3] if rank < 2 else [0, 1]
            named = "lost" in message and any(re.search(rf"rank {r}\b", message) for r in other)
        else:
            named = "lost" in message and re.search(rf"rank {victim}\b", message) is not None
        done = seen.get("done_at")
        rows.append(
            {
                "rank": rank,
                "named": bool(named),
                "hung": rank in hung,
                "seconds": round(done - began, 1) if done and began else None,
                "error": (f"{seen.get('type', 'no result')}: {message}")[:400],
            }
        )
    return {
        "case": case,
        "how": how,
        "where": where,
        "victim": victim,
        "named_on_every_survivor": all(r["named"] for r in rows),
        "hung": [r["rank"] for r in rows if r["hung"]],
        "slowest_s": max((r["seconds"] or 0) for r in rows) if rows else None,
        "ranks": rows,
    }


def bad_inputs(tree: Path, root: Path) -> list[dict]:
    import importlib.util

    sys.path.insert(0, str(ROOT))  # test_bad_input imports the tests' launcher

    spec = importlib.util.spec_from_file_location(
        "test_bad_input", ROOT / "tests" / "distributed" / "test_bad_input.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected = module.EXPECTED
    rows = []
    for name in NEW_ATTEMPTS:  # each in a job of its own: one input's failure cannot hide another's
        results, _, _ = run_job(tree, "attempts", name, root / "bad_inputs" / name)
        seen = [results.get(r, {}).get(name, "no result (hung or crashed)") for r in range(4)]
        rows.append(
            {
                "input": name,
                "clear_on_every_rank": all(expected[name] in s for s in seen),
                "rank0": seen[0][:300],
            }
        )
    return rows + [_busy_port(tree, root), _torchrun_restart(tree, root)]


_BUSY_PORT = """
import socket, sys, datetime, torch
from torch.utils.data import DataLoader, TensorDataset
held = socket.socket(); held.bind(("127.0.0.1", 0)); held.listen()
import os; os.environ["MASTER_PORT"] = str(held.getsockname()[1]); os.environ["MASTER_ADDR"] = "127.0.0.1"
import lightning.pytorch as pl
from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.models.lit_gpt import LitGPT
from lightning_zeropp.models import GPTConfig
cfg = GPTConfig(vocab_size=64, seq_len=16, dim=32, num_heads=2, num_layers=4)
x = torch.zeros(16, 16, dtype=torch.long)
strategy = ZeroPPStrategy(split="stack", pp_size=2, timeout=datetime.timedelta(seconds=20))
trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=1, logger=False,
    enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(LitGPT(cfg, micro_batch_size=1), DataLoader(TensorDataset(x, x), batch_size=4))
"""


def _busy_port(tree: Path, root: Path) -> dict:
    """Lightning starts the ranks itself on a MASTER_PORT something else holds."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK"):
        env.pop(var, None)
    proc = subprocess.Popen(
        [sys.executable, "-c", _BUSY_PORT],
        cwd=tree,  # the tree's library, not this checkout's (the current folder comes first)
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        text, _ = proc.communicate(timeout=HANG_AFTER_S + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text = "hung: still running after " + f"{HANG_AFTER_S + 60:g} s"
    (root / "busy_port.log").write_text(text)
    clear = "is in use on this machine" in text and "MASTER_PORT" in text
    return {"input": "busy_master_port (Lightning's own launch)", "clear_on_every_rank": clear,
            "rank0": text.strip().splitlines()[-1][:300] if text.strip() else ""}  # fmt: skip


def _torchrun_restart(tree: Path, root: Path) -> dict:
    """torchrun --max-restarts 1, a rank killed in the first attempt, the store shared."""
    out = root / "restart"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += ["--max-restarts=1", "-m", "tests.distributed.worker", "resume_scenarios.elastic"]
    cmd += [json.dumps({"out": str(out / "ckpt"), "init_process_group": False}), str(out)]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    proc = subprocess.Popen(
        cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        text, _ = proc.communicate(timeout=600)
        ended = f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, ended = "", "hung: still running after 600 s"
    (root / "restart.log").write_text(text)
    # The restarted attempt's own error, not the first attempt's warning, must name the fix.
    clear = "restart 1" in text and "Export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text
    named = [ln for ln in text.splitlines() if "restart 1" in ln or "Error" in ln]
    return {"input": "torchrun restart sharing its store", "clear_on_every_rank": clear,
            "rank0": f"{ended}; " + (named[-1][:250] if named else "")}  # fmt: skip


def measure(tree: Path, only: set[str] | None, label: str) -> dict:
    scenarios = _scenarios()
    root = Path(tempfile.mkdtemp(prefix=f"bench_faults_{label}_"))
    cases = []
    for case, spec in scenarios.CASES.items():
        if only is None or case in only:
            print(f"[{label}] {case}", flush=True)
            cases.append(fault_case(tree, case, spec, root))
    sys.path.insert(0, str(ROOT / "bench"))
    from netns import EmulatedCluster, unavailable

    why = unavailable()
    for case, spec in scenarios.PARTITIONS.items():
        if (only is None or case in only) and why is None:
            print(f"[{label}] {case}", flush=True)
            with EmulatedCluster(2, 2, inter_mbit=None, tag=str(os.getpid() % 10000)) as cluster:
                cases.append(fault_case(tree, case, spec, root, cluster))
    inputs: list[dict] = []
    if only is None or "bad_inputs" in only:
        try:
            inputs = bad_inputs(tree, root)
        except Exception as err:  # noqa: BLE001 - the fault cases' figures still count
            inputs = [{"input": "(the bad-input run failed)", "clear_on_every_rank": False,
                       "rank0": f"{type(err).__name__}: {err}"}]  # fmt: skip
    return {"tree": str(tree), "cases": cases, "bad_inputs": inputs, "partition": why or "ran"}


def _tree_of(rev: str) -> Path:
    tree = Path(tempfile.mkdtemp(prefix=f"lzpp_{rev}_"))
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def _commit(cwd: Path, rev: str = "HEAD") -> str:
    done = subprocess.run(["git", "rev-parse", "--short", rev], cwd=cwd, capture_output=True)
    return done.stdout.decode().strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="also run an older commit (its tree, from git archive)")
    parser.add_argument("--only", help="comma-separated cases (and 'bad_inputs')")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    results: dict[str, dict] = {}
    earlier_file = ROOT / "bench" / "results" / "faults.json"
    earlier = json.loads(earlier_file.read_text()) if only and earlier_file.exists() else {}
    if args.before:
        results["before"] = measure(_tree_of(args.before), only, "before")
        results["before"]["commit"] = _commit(ROOT, args.before)
    results["after"] = measure(ROOT, only, "after")
    results["after"]["commit"] = _commit(ROOT) + (" + uncommitted changes" if _dirty() else "")
    for label, result in results.items():  # --only: the other figures come from the last run
        kept = earlier.get(label, {})
        ran = {c["case"] for c in result["cases"]}
        result["cases"] = [c for c in kept.get("cases", []) if c["case"] not in ran] + result[
            "cases"
        ]
        if not result["bad_inputs"]:
            result["bad_inputs"] = kept.get("bad_inputs", [])
    write(results, HANG_AFTER_S)
    print((ROOT / "bench" / "results" / "faults.md").read_text())


def _dirty() -> bool:
    done = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True)
    return bool(done.stdout.strip())


if __name__ == "__main__":
    main()
