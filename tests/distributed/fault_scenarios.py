"""Ranks lost at the points the failure board must cover, in both fronts, written as users write
their runs (4 ranks, pp 2 x dp 2): Lightning's Trainer with ModelCheckpoint, and a run_clm loop
under ZeroPPAccelerator.

One launch runs a list of cases, one after another. For each case every launched rank forks a
child that runs it in a fresh process group (a port of its own, from rank 0): the victim's child
kills itself (SIGKILL) or stops (SIGSTOP) at the case's point, and its parent, once the others
are done, reports when; the others report what they raised and when they were done. Cases
named `resume:<case>` run a fresh job from the last complete checkpoint the case left and report
its losses, to compare with `straight` (the same run, never killed).

Only public entry points are used (faults are injected through callbacks, hooks and torch's
DCP writer), so `bench/bench_faults.py` runs the same cases on an older tree for its 'before'
figures.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import math
import os
import signal
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import torch

LAYOUT = {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 2}
STEPS = 6
# case: (front, victim, signal, where). `where` is the point the victim is lost at.
CASES: dict[str, tuple[str, int, str, str]] = {
    "lightning_setup": ("lightning", 1, "kill", "setup"),
    "lightning_step": ("lightning", 2, "kill", "step"),
    "lightning_rank0_step": ("lightning", 0, "kill", "step"),
    "lightning_sync_save": ("lightning", 3, "kill", "save"),
    "lightning_async_save": ("lightning", 3, "kill", "async_save"),
    "lightning_validation": ("lightning", 2, "kill", "validation"),
    "lightning_stopped_step": ("lightning", 1, "stop", "step"),
    "lightning_stopped_async_save": ("lightning", 1, "stop", "async_save"),
    "accelerate_prepare": ("accelerate", 1, "kill", "prepare"),
    "accelerate_step": ("accelerate", 2, "kill", "step"),
    "accelerate_rank0_step": ("accelerate", 0, "kill", "step"),
    "accelerate_save_state": ("accelerate", 3, "kill", "save"),
    "accelerate_gather": ("accelerate", 1, "kill", "gather"),
}
# Network partitions (no victim: bench/bench_faults.py cuts the link between two emulated nodes
# once every rank has written `ready<rank>`; the runs go on until then).
PARTITIONS: dict[str, tuple[str, int, str, str]] = {
    "lightning_partition": ("lightning", -1, "cut", "partition"),
    "accelerate_partition": ("accelerate", -1, "cut", "partition"),
}


# ------------------------------------------------------------------------------ the launch
def run_cases(cases: list[str], out: str, timeout_s: float = 20.0) -> dict[str, Any]:
    """Every launched rank: each case in a forked child, one after another; this rank's reports."""
    rank, root = int(os.environ["RANK"]), Path(out)
    reports: dict[str, Any] = {}
    for case in cases:
        where = root / case.replace(":", "_")
        where.mkdir(parents=True, exist_ok=True)
        port = _case_port(where, rank)
        reports[case] = _fork_case(case, where, port, timeout_s)
    return reports


def _case_port(where: Path, rank: int) -> int:
    """A free port for the case's process group: rank 0 picks it, the others read it."""
    file = where / "port"
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        (where / "port.tmp").write_text(str(port))
        (where / "port.tmp").rename(file)
    while not file.exists():
        time.sleep(0.05)
    return int(file.read_text())


def _fork_case(case: str, where: Path, port: int, timeout_s: float) -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    victim = CASES[case][1] if case in CASES else -1
    pid = os.fork()
    if pid == 0:  # the child: never returns into the worker
        code = 1
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with its parent
            os.environ["MASTER_PORT"] = str(port)
            torch.save(_run(case, where, timeout_s), where / f"result{rank}.pt")
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + 3 * timeout_s + 240  # past any bound the test checks
    if rank == victim:  # killed or stopped: wait for the others, then make sure it is gone
        others = [where / f"result{r}.pt" for r in range(4) if r != victim]
        while not all(p.exists() for p in others) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        lost = where / "lost_at"
        return {"victim": True, "lost_at": float(lost.read_text()) if lost.exists() else None}
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:  # hung past every bound: say so, and end it
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return {"victim": False, "hung": True}
    result = where / f"result{rank}.pt"
    if not result.exists():
        return {"victim": False, "hung": False, "crashed": os.waitstatus_to_exitcode(status)}
    return torch.load(result, weights_only=False) | {"victim": False, "hung": False}


def _run(case: str, where: Path, timeout_s: float) -> dict[str, Any]:
    """One case on this rank: what it raised (or its losses) and when it was done."""
    name = case.removeprefix("resume:")
    known = CASES | PARTITIONS
    front = known[name][0] if name in known else name.split("_")[0]
    fault = _Fault(*known[name][1:], where) if case in known else None
    resume_from = where.parent / name if case.startswith("resume:") else None
    seen: dict[str, Any] = {"type": "no error"}
    try:
        run = _lightning if front == "lightning" else _accelerate
        seen |= run(where, fault, timeout_s, resume_from)
    except BaseException as err:  # noqa: BLE001 - the test inspects what was raised
        seen |= {
            "type": type(err).__name__,
            "message": str(err)[:2000],
            "origin": getattr(err, "origin", None),
        }
    seen["done_at"] = time.time()
    return seen


class _Fault:
    """Where and how the victim is lost; `maybe(point)` loses it when `point` is its own."""

    def __init__(self, victim: int, how: str, where: str, out: Path) -> None:
        self.victim, self.how, self.where, self.out = victim, how, where, out
        self.rank = int(os.environ["RANK"])
        self.count = 0

    def maybe(self, point: str, nth: int = 1) -> None:
        if point == self.where == "partition":  # every rank: ready to be cut off, going on
            if not (ready := self.out / f"ready{self.rank}").exists():
                ready.write_text(repr(time.time()))
            time.sleep(0.1)
            return
        if point != self.where or self.rank != self.victim:
            return
        self.count += 1
        if self.count == nth:
            (self.out / "lost_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL if self.how == "kill" else signal.SIGSTOP)


def _lose_in_writes(fault: _Fault | None, nth: int) -> None:
    """The victim is lost inside DCP's file writes (the `nth` write of its run)."""
    from torch.distributed.checkpoint import FileSystemWriter

    if fault is None or "save" not in fault.where:
        return
    write = FileSystemWriter.write_data

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        fault.maybe(fault.where, nth)
        return write(self, plan, planner)

    FileSystemWriter.write_data = write_data  # this child process only


# ------------------------------------------------------------------------------ Lightning
def _lightning(
    where: Path, fault: _Fault | None, timeout_s: float, resume_from: Path | None
) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_zeropp import ZeroPPStrategy
    from tests.distributed.resume_scenarios import PlainLM, Record, TokenRows

    class Lose(pl.Callback):
        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if fault:
                fault.maybe("setup")

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if fault and trainer.global_step == 2:
                fault.maybe("step")
            if fault and trainer.global_step >= 2:
                fault.maybe("partition")

        def on_validation_batch_start(self, *args: Any) -> None:
            if fault:
                fault.maybe("validation")

    class Validated(PlainLM):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
            self.log("val_loss", loss)

        def val_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(TokenRows(16), batch_size=4, drop_last=True)

    kind = fault.where if fault else ""
    _lose_in_writes(fault, nth=3)  # the save at step 4 (step=2.ckpt and last.ckpt came before)
    record = Record()
    checkpoints = ModelCheckpoint(
        dirpath=(resume_from or where) / "ckpt",  # a resumed run reads the killed run's
        filename="{step}",
        every_n_train_steps=2,
        save_top_k=-1,
        save_last=True,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=ZeroPPStrategy(
            **LAYOUT,
            timeout=datetime.timedelta(seconds=timeout_s),
            async_save="async" in kind,
        ),
        max_steps=10**6 if kind == "partition" else STEPS,
        callbacks=[record, checkpoints, Lose()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        val_check_interval=2 if kind == "validation" else None,
        limit_val_batches=2 if kind == "validation" else 0,
        num_sanity_val_steps=0,
    )
    module = Validated(init_seed=7 if resume_from else 0)
    trainer.fit(module, ckpt_path="last" if resume_from else None)
    return {"steps": record.steps, "losses": record.losses, "params": _params(module.model)}


# ------------------------------------------------------------------------------ Accelerate
def _accelerate(
    where: Path, fault: _Fault | None, timeout_s: float, resume_from: Path | None
) -> dict[str, Any]:
    from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
    from torch.utils.data import DataLoader

    from lightning_zeropp.accelerate import ZeroPPAccelerator, ZeroPPPlugin
    from tests.distributed.clm_loop import Args, Texts, build_model, collate

    _lose_in_writes(fault, nth=2)  # the save_state after update 4
    accelerator = ZeroPPAccelerator(
        zeropp_plugin=ZeroPPPlugin(**LAYOUT),
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=timeout_s))],
    )
    model = build_model(Args(init_seed=7 if resume_from else 0))
    set_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    loader = DataLoader(Texts(48, 1), shuffle=True, collate_fn=collate, batch_size=2)
    evals = DataLoader(Texts(8, 2), collate_fn=collate, batch_size=2)
    if fault:
        fault.maybe("prepare")
    model, optimizer, loader, evals = accelerator.prepare(model, optimizer, loader, evals)
    saved = (resume_from or where) / "state"
    done, skip = 0, 0
    if resume_from is not None:
        accelerator.load_state(str(saved / "step_2"))
        done = skip = 2
    out: dict[str, Any] = {"steps": [], "losses": []}
    epochs = 10**6 if fault and fault.where == "partition" else 1
    batches = (b for _ in range(epochs) for b in loader)
    for batch in accelerator.skip_first_batches(loader, skip) if skip else batches:
        if fault and done == 2:
            fault.maybe("step")
        if fault and done >= 2:
            fault.maybe("partition")
        outputs = model(**batch)
        accelerator.backward(outputs.loss)
        optimizer.step()
        optimizer.zero_grad()
        done += 1
        out["steps"].append(done)
        out["losses"].append(float(outputs.loss.detach()))
        if done % 2 == 0 and epochs == 1:
            accelerator.save_state(str(saved / f"step_{done}"))
        if done == 3:  # run_clm's evaluation: losses gathered for the perplexity
            model.eval()
            with torch.no_grad():
                if fault:
                    fault.maybe("gather")
                losses = [accelerator.gather_for_metrics(model(**b).loss.reshape(1)) for b in evals]
            out["perplexity"] = math.exp(float(torch.cat(losses).mean()))
            model.train()
        if done == STEPS and epochs == 1:
            break
    out["params"] = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    return out


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    full = {}
    for name, p in model.named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        full[name] = value.detach().clone()
    return full


def summary(reports: list[dict[str, Any]], case: str) -> dict[str, Any]:
    """What a case came to over the ranks: whether every survivor named the victim, the slowest
    survivor's time from the loss to done, and hangs."""
    _, victim, _, _ = CASES[case]
    lost_at = reports[victim][case].get("lost_at")
    survivors = [r[case] for rank, r in enumerate(reports) if rank != victim]
    named = [
        f"rank {victim}" in s.get("message", "") and "lost" in s.get("message", "")
        for s in survivors
    ]
    times = [s["done_at"] - lost_at for s in survivors if "done_at" in s and lost_at]
    return {
        "named": sum(named),
        "survivors": len(survivors),
        "hung": sum(bool(s.get("hung")) for s in survivors),
        "slowest_s": max(times) if len(times) == len(survivors) else None,
        "messages": sorted({json.dumps(s.get("message", s.get("type")))[:300] for s in survivors}),
    }
