"""SIGTERM (a scheduler preempting the job) at the points a run can be in, in each front.

One launch (2 ranks, pp 2) runs a list of cases, one after another; each case runs on every
rank in a forked child with a fresh process group (a port of its own: `fault_scenarios`). In a
case `<front>_<point>_<who>` the child SIGTERMs itself at `point` when it is one of `who`
("one": rank 1, "all": every rank, as schedulers signal a whole job). The parent reports the
child's exit status, what it raised, and whether it outlived its bound (a hang).
`<front>_straight` runs unsignalled; `resume:<case>` restarts from the checkpoint the case saved
(`save_on_sigterm=True`) and reports its losses, to compare with `straight`.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from tests.distributed.fault_scenarios import _case_port

LAYOUT = {"pp_size": 2, "num_microbatches": 2}
STEPS = 6
POINTS = ("setup", "step", "save", "validation", "last")


def run_cases(cases: list[str], out: str, timeout_s: float = 20.0) -> dict[str, Any]:
    """Every launched rank: each case in a forked child, one after another; this rank's reports."""
    rank, root = int(os.environ["RANK"]), Path(out)
    reports: dict[str, Any] = {}
    for case in cases:
        where = root / case.replace(":", "_")
        where.mkdir(parents=True, exist_ok=True)
        reports[case] = _fork_case(case, where, _case_port(where, rank), timeout_s)
    return reports


def _fork_case(case: str, where: Path, port: int, timeout_s: float) -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    result = where / f"result{rank}.pt"
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the worker
        code = 1
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with its parent
            os.environ["MASTER_PORT"] = str(port)
            seen = _run(case, where, timeout_s)
            code = seen.pop("code")
            torch.save(seen, result)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = start + 2 * timeout_s + 120  # past the timeout: a hang
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return {"hung": True, "exit": None}
    seen = torch.load(result, weights_only=False) if result.exists() else {}
    took = time.monotonic() - start
    return seen | {"hung": False, "exit": os.waitstatus_to_exitcode(status), "took_s": took}


def _run(case: str, where: Path, timeout_s: float) -> dict[str, Any]:
    """One case on this rank: what it raised (or its losses), and the exit status it chose."""
    name = case.removeprefix("resume:")
    front, point, who = (name.split("_") + ["", ""])[:3]
    rank = int(os.environ["RANK"])
    resume = where.parent / name if case.startswith("resume:") else None
    signalled = who == "all" or (who == "one" and rank == 1)
    signal_at = point if signalled and resume is None else None
    seen: dict[str, Any] = {"type": "no error", "code": 0}
    try:
        run = {"lightning": _lightning, "accelerate": _accelerate, "trainer": _trainer}[front]
        seen |= run(where, point, signal_at, timeout_s, resume)
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
        seen |= {"type": type(err).__name__, "message": str(err)[:2000], "code": code}
    except BaseException as err:  # noqa: BLE001 - the test inspects what was raised
        seen |= {"type": type(err).__name__, "message": str(err)[:2000], "code": 1}
        seen["trace"] = traceback.format_exc()[-4000:]
    return seen


def _sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def _lightning(
    where: Path, point: str, signal_at: str | None, timeout_s: float, resume: Path | None
) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.checkpoint import FileSystemWriter

    from lightning_zeropp import ZeroPPStrategy
    from tests.distributed.resume_scenarios import PlainLM, Record, TokenRows

    class Signal(pl.Callback):
        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if signal_at == "setup":
                _sigterm()

        def on_validation_batch_start(self, *args: Any) -> None:
            if signal_at == "validation":
                _sigterm()

    class Module(PlainLM):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            step, rank = self.trainer.global_step, self.trainer.global_rank
            if signal_at == "step" and step == 2 and rank == 0:
                _sigterm()  # stage 0: before the step's agreement
            logits = self.model(x)
            # On the last stage this runs inside the pipeline's schedule: mid-step.
            last = {"step": 2, "last": STEPS - 1}
            if rank == 1 and signal_at in last and step == last[signal_at]:
                _sigterm()
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", F.cross_entropy(self.model(x).flatten(0, 1), y.flatten()))

        def val_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(TokenRows(8), batch_size=4, drop_last=True)

    if signal_at == "save":  # inside DCP's file writes of the save at step 2
        write = FileSystemWriter.write_data

        def write_data(self: Any, plan: Any, planner: Any) -> Any:
            _sigterm()
            return write(self, plan, planner)

        FileSystemWriter.write_data = write_data  # this child process only

    record = Record()
    root = resume or where
    checkpoints = ModelCheckpoint(
        dirpath=root / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=1
    )
    validating = point == "validation"  # the same Trainer on every rank, signalled or not
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroPPStrategy(
            **LAYOUT,
            timeout=datetime.timedelta(seconds=timeout_s),
            save_on_sigterm=point != "straight",
        ),
        default_root_dir=root,
        max_steps=STEPS,
        callbacks=[record, Signal()] + ([checkpoints] if point == "save" else []),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        val_check_interval=2 if validating else None,
        limit_val_batches=2 if validating else 0,
        num_sanity_val_steps=0,
    )
    module = Module(init_seed=7 if resume else 0)
    trainer.fit(module, ckpt_path="hpc" if resume else None)
    params = {}
    for name, p in module.model.named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        params[name] = value.detach().clone()
    return {"steps": record.steps, "losses": record.losses, "params": params}


def _accelerate(
    where: Path, point: str, signal_at: str | None, timeout_s: float, resume: Path | None
) -> dict[str, Any]:
    """run_clm's loop under ZeroPPAccelerator; a restart loads the state the stop saved and
    skips the batches trained before it, as run_clm resumes."""
    from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
    from torch.utils.data import DataLoader

    from lightning_zeropp.accelerate import ZeroPPAccelerator, ZeroPPPlugin
    from tests.distributed.clm_loop import Args, Texts, build_model, collate

    root = resume or where
    handler = signal.getsignal(signal.SIGTERM)  # the one before the library's
    accelerator = ZeroPPAccelerator(
        zeropp_plugin=ZeroPPPlugin(**LAYOUT, save_on_sigterm=point != "straight"),
        cpu=True,
        project_dir=str(root),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=timeout_s))],
    )
    model = build_model(Args(init_seed=7 if resume else 0))
    set_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    loader = DataLoader(Texts(24, 1), shuffle=True, collate_fn=collate, batch_size=2)
    evals = DataLoader(Texts(4, 2), collate_fn=collate, batch_size=2)
    if signal_at == "setup":
        _sigterm()  # before prepare: the first step stops
    model, optimizer, loader, evals = accelerator.prepare(model, optimizer, loader, evals)
    done = 0
    if resume is not None:
        saved = sorted(resume.glob("sigterm_step_*"))[-1]
        accelerator.load_state(str(saved))
        done = int(saved.name.rsplit("_", 1)[1])
    if signal_at == "step":  # inside the schedule, on this rank's stage, during step 4
        for module in model.module.modules():
            module.register_forward_hook(lambda *_: _sigterm() if done == 3 else None)
    out: dict[str, Any] = {"steps": [], "losses": []}
    for batch in accelerator.skip_first_batches(loader, done) if done else loader:
        outputs = model(**batch)
        accelerator.backward(outputs.loss)
        optimizer.step()
        optimizer.zero_grad()
        done += 1
        out["steps"].append(done)
        out["losses"].append(float(outputs.loss.detach()))
        if done == 2:  # run_clm's evaluation
            model.eval()
            if signal_at == "validation":
                _sigterm()
            with torch.no_grad():
                [model(**b) for b in evals]
            model.train()
        if done == STEPS:
            if signal_at == "last":
                _sigterm()  # after the last step: end_training() agrees
            break
    out["params"] = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    out["batches"] = model.stopper.batches  # the step a SIGTERM message names: goes on
    mine = signal.getsignal(signal.SIGTERM)  # the library's, during the run
    accelerator.end_training()
    out["handler_restored"] = mine is not handler and signal.getsignal(signal.SIGTERM) is handler
    return out


def _trainer(
    where: Path, point: str, signal_at: str | None, timeout_s: float, resume: Path | None
) -> dict[str, Any]:
    """The HF fine-tuning script under ZeroPPTrainer; a restart resumes from the checkpoint the
    stop saved (`resume_from_checkpoint=True`)."""
    from lightning_zeropp.accelerate import ZeroPPPlugin
    from lightning_zeropp.transformers import ZeroPPTrainer
    from tests.distributed import trainer_script

    handler, during = signal.getsignal(signal.SIGTERM), []

    class Signalled(ZeroPPTrainer):
        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            during.append(signal.getsignal(signal.SIGTERM))
            if signal_at == "step" and self.state.global_step == 2:
                _sigterm()  # before step 3's agreement
            loss = super().training_step(*args, **kwargs)
            if signal_at == "last" and self.state.global_step == STEPS - 1:
                _sigterm()  # after the last step's agreement: train() ends, then agrees
            return loss

    script = trainer_script.Script(args={"max_steps": STEPS, "seed": 0})
    plugin = ZeroPPPlugin(**LAYOUT, save_on_sigterm=point != "straight")
    out = trainer_script.run(
        Signalled, script, str(resume or where), resume=bool(resume) or None, zeropp_plugin=plugin
    )
    losses = [log["loss"] for log in out["logs"] if "loss" in log]
    steps = list(range(STEPS - len(losses) + 1, STEPS + 1))  # one log per step: the last ones
    restored = during[0] is not handler and signal.getsignal(signal.SIGTERM) is handler
    return {"steps": steps, "losses": losses, "params": {}, "handler_restored": restored}
