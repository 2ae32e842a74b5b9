"""core.failure on 4 gloo ranks, a (pp 2 x dp_shard 2) mesh: ranks 0, 1 hold stage 0; 2, 3 stage 1.

Each scenario initializes its own process group with a 300 s timeout, so a rank that wakes within
seconds was woken by the failure board, not by the timeout. The ranks report what they saw
instead of dying, so the test can compare them.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_zeropp.core._torch_private import default_store
from lightning_zeropp.core.failure import FailureBoard, describe_rank

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
    engine = ZeroPPEngine(make_model(), config, loss_fn=loss_fn, example_args=example)
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
