"""core.step.failure on 4 gloo ranks, a (pp 2 x dp_shard 2) mesh: ranks 0, 1 hold stage 0; 2, 3 stage 1.

Each scenario initializes its own process group, most with a 300 s timeout, so a rank that wakes
within seconds was woken by the failure board, not by the timeout (`mesh_timeouts` and a stopped
rank in `lost_rank` take a short one: there the timeout is what wakes). The ranks report what
they saw instead of dying, so the test can compare them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_zeropp.core._torch_private import default_store
from lightning_zeropp.core.step.failure import FailureBoard, describe_rank

TIMEOUT = timedelta(seconds=300)


def _setup() -> tuple[DeviceMesh, FailureBoard]:
    dist.init_process_group("gloo", timeout=TIMEOUT)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    groups = [dist.group.WORLD, mesh.get_group("pp"), mesh.get_group("dp_shard")]
    description = describe_rank(mesh, [mesh.get_local_rank("pp")])
    # grace_s above the test's 30 s bound: an origin that woke nobody would hold its connections
    # open (the waiting ranks blocked) for 60 s, then exit and wake them: too late to pass.
    return mesh, FailureBoard(description, groups=groups, grace_s=60.0)


def _raised(err: Exception) -> dict[str, Any]:
    return {
        "type": type(err).__name__,
        "message": str(err),
        "cause": type(err.__cause__).__name__ if err.__cause__ else None,
        "notes": list(getattr(err, "__notes__", ())),
        "origin": getattr(err, "origin", None),
        "raised_at": time.time(),
    }


def peer_fails(origins: list[int], ending: str = "destroy", out_dir: str = "") -> dict[str, Any]:
    """The ranks in `origins` raise ValueError("bad loss shape") inside the guard, 0.5 s in.

    Meanwhile the rank after an origin in the pipeline waits in `recv` for it (as a stage waits
    for activations), and every other rank sits in an all_reduce over its dp_shard group: with
    the origin, or with a rank that is itself blocked (woken only second-hand). Each origin also
    leaves a receive posted, as a schedule would.

    `ending`: "destroy" calls destroy_process_group() and reports how long it took;
    "interpreter" saves the result to `out_dir` and exits with the process groups still alive.
    """
    mesh, board = _setup()
    rank = dist.get_rank()
    pp, dp = mesh.get_group("pp"), mesh.get_group("dp_shard")
    peer_of = {(o + 2) % 4: o for o in origins}  # rank -> the origin it receives from
    failed_at = None
    dist.barrier()
    try:
        with board.guard():
            if rank in origins:
                dist.irecv(torch.zeros(2), src=(rank + 2) % 4, group=pp)
                time.sleep(0.5)  # the others are blocked by now
                failed_at = time.time()
                raise ValueError("bad loss shape")
            if rank in peer_of:
                dist.recv(torch.zeros(4), src=peer_of[rank], group=pp)
            else:
                dist.all_reduce(torch.ones(4), group=dp)
        seen: dict[str, Any] = {"type": "no error"}
    except Exception as err:  # noqa: BLE001 - the test inspects what was raised
        seen = _raised(err)
    seen["failed_at"] = failed_at
    if ending == "interpreter":
        torch.save(seen, Path(out_dir) / f"result{rank}.pt")
        raise SystemExit(0)  # the worker neither saves nor destroys: plain interpreter exit
    start = time.monotonic()
    dist.destroy_process_group()
    seen["destroy_s"] = time.monotonic() - start
    return seen


def engine_step_fails(schedule: str) -> dict[str, Any]:
    """A real pipeline step under the guard: step 0 succeeds, then the loss function raises on
    rank 3 (last stage, dp_shard 1) in step 1 while the other ranks are inside the schedule.

    Reports the happy path too: the store keys step 0 added (none expected) and the guard's cost.
    """
    from lightning_zeropp import launch_layout
    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
    from tests.distributed.common import MODEL, lm_loss, make_batches, make_model

    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank, step = dist.get_rank(), 0
    seen: dict[str, Any] = {"type": "no error"}

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if rank == 3 and step == 1:
            seen["failed_at"] = time.time()
            raise ValueError("bad loss shape")
        return lm_loss(output, target)

    config = ZeroPPConfig(pp_size=2, dp_shard_size=2, num_microbatches=4, schedule=schedule)
    example = (torch.zeros(2, MODEL.seq_len, dtype=torch.long),)
    engine = ZeroPPEngine(
        make_model(), launch_layout(config), loss_fn=loss_fn, example_args=example
    )
    board = FailureBoard(describe_rank(engine.dims.mesh, engine.stage_ids), grace_s=60.0)
    store = default_store()
    batches = make_batches(2)
    rows = slice(engine.dims.dp_rank * 8, engine.dims.dp_rank * 8 + 8)
    try:
        for step, (x, y) in enumerate(batches):  # loss_fn reads `step`
            dist.barrier()  # every rank is past set-up (which uses the store) and past step 0
            keys_before = store.num_keys()
            with board.guard():
                seen[f"loss{step}"] = engine.train_step(x[rows], target=y[rows]).item()
            dist.barrier()
            seen["new_keys"] = store.num_keys() - keys_before
            start = time.perf_counter()
            for _ in range(1000):
                with board.guard():
                    pass
            seen["guard_us"] = (time.perf_counter() - start) * 1e3
    except Exception as err:  # noqa: BLE001 - the test inspects what was raised
        seen.update(_raised(err))
    seen["failed_at"] = seen.get("failed_at")
    start = time.monotonic()
    dist.destroy_process_group()
    seen["destroy_s"] = time.monotonic() - start
    return seen


def mesh_timeouts(timeout_s: float) -> dict[str, Any]:
    """The groups the library creates get the world's timeout, and one blocked fails after it.

    Reports every mesh axis's timeout and a tied-weights group's, then: rank 0 waits in a
    point-to-point recv over the pp group for rank 2 (gloo's receive waits on the timeout the
    group was created with: a later set_timeout would not reach it) and rank 3 in an all_reduce
    over dp_shard with rank 2, which sleeps (alive, connections open) as long as rank 1.
    """
    from lightning_zeropp.core import ZeroPPConfig, build_mesh
    from lightning_zeropp.core._torch_private import group_timeout
    from lightning_zeropp.core.split.tied import _holder_group

    _init_gloo(timeout_s)
    rank = dist.get_rank()
    dims = build_mesh(ZeroPPConfig(pp_size=2, dp_shard_size=2).resolve(4), "cpu")
    seen: dict[str, Any] = {"type": "no error"}
    for axis in ("pp", "dp_replicate", "dp_shard"):
        seen[axis] = group_timeout(dims.mesh.get_group(axis)).total_seconds()
    # Pipeline ranks 0 and 3 of a 4-stage mesh share a tied weight: a group of their own.
    tied = _holder_group((0, 3), build_mesh(ZeroPPConfig(pp_size=4).resolve(4), "cpu"))
    seen["tied"] = group_timeout(tied).total_seconds() if tied is not None else None
    dist.barrier()
    start = time.monotonic()
    try:
        if rank == 0:
            dist.recv(torch.zeros(2), src=2, group=dims.pp_group)
        elif rank == 3:
            dist.all_reduce(torch.ones(2), group=dims.mesh.get_group("dp_shard"))
        else:
            time.sleep(timeout_s + 5)  # outlives the others' timeout: they must not wait for it
    except Exception as err:  # noqa: BLE001 - the test inspects what was raised
        seen.update(_raised(err))
    seen["blocked_s"] = time.monotonic() - start
    return seen


def lost_rank(how: str, victim: int, timeout_s: float, out_dir: str, child: bool = False) -> Any:
    """Rank `victim` is lost in the middle of a pipeline step: SIGKILLed (`how="kill"`) or
    SIGSTOPped (`how="stop"`) in a forward of step 1 (step 0 succeeds).

    The victim's rank runs in a child of the launched process, which reports for it (a killed
    or stopped process reports nothing) and, once every other rank has saved its result, kills
    it, so no stopped process outlives the test (nor the launcher's kill of the parent). The others report what they raised and when
    they were done (process group destroyed); the victim writes the time it was lost.
    """
    rank = int(os.environ["RANK"])
    if rank == victim and not child:
        return _keep_victim(dict(how=how, victim=victim, timeout_s=timeout_s, out_dir=out_dir))
    from lightning_zeropp import launch_layout
    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
    from tests.distributed.common import MODEL, lm_loss, make_batches, make_model

    _init_gloo(timeout_s)
    config = ZeroPPConfig(pp_size=2, dp_shard_size=2, num_microbatches=4)
    example = (torch.zeros(2, MODEL.seq_len, dtype=torch.long),)
    engine = ZeroPPEngine(
        make_model(), launch_layout(config), loss_fn=lm_loss, example_args=example
    )
    forwards, step = 0, 0

    def lose(*_: Any) -> None:  # a forward pre-hook on the victim's last module
        nonlocal forwards
        forwards += step == 1
        if rank == victim and forwards == 2:  # micro-batch 1 of step 1
            (Path(out_dir) / "lost_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)

    list(engine.module.modules())[-1].register_forward_pre_hook(lose)
    rows = slice(engine.dims.dp_rank * 8, engine.dims.dp_rank * 8 + 8)
    seen: dict[str, Any] = {"type": "no error"}
    try:
        for step, (x, y) in enumerate(make_batches(2)):  # noqa: B007 - `lose` reads `step`
            engine.train_step(x[rows], target=y[rows])
    except Exception as err:  # noqa: BLE001 - the test inspects what was raised
        seen.update(_raised(err))
    start = time.monotonic()
    dist.destroy_process_group()
    seen["destroy_s"] = time.monotonic() - start
    seen["done_at"] = time.time()
    return seen


def _keep_victim(params: dict[str, Any]) -> dict[str, Any]:
    """Run the victim rank in a forked child (torch already imported); kill it once the other
    ranks are done (or late)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into the worker
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with its parent
            lost_rank(**params, child=True)
        except BaseException:
            traceback.print_exc()  # into the rank's log, which the child shares
        finally:
            os._exit(1)  # the victim is meant to be killed or stopped before this
    out = Path(params["out_dir"])
    others = [out / f"result{r}.pt" for r in range(4) if r != params["victim"]]
    deadline = time.monotonic() + params["timeout_s"] + 120
    while not all(p.exists() for p in others) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)  # the last result being written
    os.kill(pid, signal.SIGKILL)  # ends a stopped process too; a killed one is a zombie: no-op
    _, status = os.waitpid(pid, 0)
    lost_at = out / "lost_at"
    return {
        "returncode": os.waitstatus_to_exitcode(status),
        "pid": pid,
        "lost_at": float(lost_at.read_text()) if lost_at.exists() else None,
    }


def _init_gloo(timeout_s: float) -> None:
    """A world group with a `timeout_s` timeout, over a store that waits longer for the ranks to
    start (on a loaded machine they start seconds apart)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(addr, port, world, rank == 0, timedelta(seconds=120))
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
