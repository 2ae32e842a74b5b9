"""Scenarios on ranks that run on emulated hosts (a UTS namespace each, `hosts_cluster.py`),
numbered across them as a launcher may (SLURM's cyclic distribution): host-aware placement,
and the pipeline links checked at setup."""

from __future__ import annotations

import os
import subprocess
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import lightning_zeropp.core.mesh as mesh_module
from lightning_zeropp import launch_layout
from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from lightning_zeropp.core._torch_private import default_store
from lightning_zeropp.core.hosts import Placement, this_host
from lightning_zeropp.core.measure.comm import CommCounter
from lightning_zeropp.core.measure.layout import placement_lines
from lightning_zeropp.core.measure.traffic import NodeTraffic
from lightning_zeropp.core.step.failure import failure_guard
from tests.distributed.common import GLOBAL_BATCH, MODEL, lm_loss, make_batches, make_model
from tests.distributed.core_scenarios import _full, _rows


def train(cases: list[dict[str, Any]], steps: int = 3) -> dict[str, Any]:
    """Each case {"id", "layout", "rank_numbered"}: SGD for `steps`; the losses, full
    parameters, each dp_shard group's hosts, the layout's host lines, and the bytes the last step
    sent across hosts (`NodeTraffic` over the real hosts). `rank_numbered`: the mesh over the
    ranks as numbered (what the library did before it read the hosts), for the comparison."""
    return {case["id"]: _train(steps=steps, **case) for case in cases}


def _train(id: str, layout: dict[str, Any], steps: int, rank_numbered: bool = False) -> dict:
    config = ZeroPPConfig(**layout).resolve(dist.get_world_size())
    micro = GLOBAL_BATCH // config.dp_size // config.num_microbatches
    example = (torch.zeros(micro, MODEL.seq_len, dtype=torch.long),)
    original = mesh_module.gather_placement
    if rank_numbered:  # the ranks as numbered, hosts still known (for the bytes' accounting)

        def as_numbered(group: int, device: str) -> Placement:
            placed = original(group, device)
            return Placement(tuple(range(len(placed.hosts))), placed.hosts, placed.devices)

        mesh_module.gather_placement = as_numbered
    try:
        engine = ZeroPPEngine(
            make_model(), launch_layout(config), loss_fn=lm_loss, example_args=example
        )
    finally:
        mesh_module.gather_placement = original
    placement = engine.dims.placement
    assert placement is not None
    opt = torch.optim.SGD(engine.parameters(), lr=0.5)
    traffic = NodeTraffic(engine.dims.mesh, config.node_size, placement.hosts)
    losses, sent, first_step_done = [], {}, 0.0
    for step, (x, y) in enumerate(make_batches(steps)):
        rows = _rows(engine, GLOBAL_BATCH)
        with CommCounter(traffic) as comm:
            loss = engine.train_step(x[rows], target=y[rows])
        if step == steps - 1:
            sent = traffic.sent(comm.summary())
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        if step == 0:  # wall-clock time (the launchers' time to first step, bench_hosts.py)
            first_step_done = time.time()
    mesh = engine.dims.mesh.mesh
    groups = mesh.reshape(-1, mesh.shape[-1]).tolist()
    partition = engine._plus.partition_mesh if engine._plus is not None else None
    partitions = partition.mesh.tolist() if partition is not None else []
    return {
        "host": this_host(),
        "losses": losses,
        "params": {n: _full(p) for n, p in engine.module.named_parameters()},
        "group_hosts": [sorted({placement.hosts[r] for r in g}) for g in groups],
        "partition_hosts": [sorted({placement.hosts[r] for r in g}) for g in partitions],
        "order": list(placement.order),
        "lines": placement_lines(engine.dims),
        "sent": sent,
        "first_step_done": first_step_done,
    }


def cut_link(layout: dict[str, Any], device: str, timeout_s: float) -> dict[str, Any]:
    """Build an engine whose pipeline link is cut after the mesh's groups exist and before its
    check (this rank takes its node's data link, `device`, down; the store's link stays up):
    every rank must raise naming the link, within the groups' timeout."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    config = ZeroPPConfig(**layout).resolve(dist.get_world_size())
    original = mesh_module.check_links

    def cut_first(*args: Any, **kwargs: Any) -> None:
        dist.barrier()  # every group connected; then the data link goes down
        store = default_store()  # on the control link, which stays up
        if os.environ.get("LZPP_CUT_HERE") == "1":
            subprocess.run(["ip", "link", "set", device, "down"], check=True)
            store.set("lzpp_test_cut", "1")
        store.wait(["lzpp_test_cut"])
        original(*args, **kwargs)

    mesh_module.check_links = cut_first
    start = time.monotonic()
    error = None
    try:
        micro = GLOBAL_BATCH // config.dp_size // config.num_microbatches
        example = (torch.zeros(micro, MODEL.seq_len, dtype=torch.long),)
        with failure_guard():
            ZeroPPEngine(make_model(), launch_layout(config), loss_fn=lm_loss, example_args=example)
    except Exception as err:  # what the user sees: the error and its causes
        error, cause = f"{type(err).__name__}: {err}", err.__cause__
        while cause is not None:
            error += f"\n  caused by {type(cause).__name__}: {cause}"
            cause = cause.__cause__
    finally:
        mesh_module.check_links = original
    return {"host": this_host(), "error": error, "seconds": time.monotonic() - start}


def slurm_fit(layout: dict[str, Any], steps: int = 3) -> dict[str, Any]:
    """`Trainer(strategy=ZeroPPStrategy(...), num_nodes=2, devices=2)` under srun's variables
    (Lightning's SLURMEnvironment): the logged losses, parameters and the strategy's placement."""
    import lightning.pytorch as pl

    from lightning_zeropp import ZeroPPStrategy
    from lightning_zeropp.models.lit_gpt import LitGPT
    from tests.distributed import lightning_scenarios as lit

    strategy = ZeroPPStrategy(**layout)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, deterministic=True,
    )  # fmt: skip
    dp = int(os.environ["SLURM_NTASKS"]) // layout.get("pp_size", 1)
    micro = GLOBAL_BATCH // dp // layout.get("num_microbatches", 1)
    module = LitGPT(MODEL, micro_batch_size=micro, optimizer="sgd", lr=0.5)
    module.model.load_state_dict(make_model(0).state_dict())
    record = lit.Record()
    trainer.callbacks.append(record)
    trainer.fit(module, lit._loader(steps, dp))
    placement = strategy.engine.dims.placement
    assert placement is not None
    mesh = strategy.engine.dims.mesh.mesh
    return {
        "host": this_host(),
        "environment": type(trainer.strategy.cluster_environment).__name__,
        "logged": record.logged,
        "params": {n: _full(p) for n, p in module.model.named_parameters()},
        "group_hosts": [
            sorted({placement.hosts[r] for r in g})
            for g in mesh.reshape(-1, mesh.shape[-1]).tolist()
        ],
        "node_size": strategy.engine.config.node_size,
    }


def refused(layout: dict[str, Any]) -> dict[str, Any]:
    """Build an engine on hosts that cannot hold the layout: the error this rank raised."""
    config = ZeroPPConfig(**layout).resolve(dist.get_world_size())
    micro = GLOBAL_BATCH // config.dp_size // config.num_microbatches
    example = (torch.zeros(micro, MODEL.seq_len, dtype=torch.long),)
    try:
        ZeroPPEngine(make_model(), launch_layout(config), loss_fn=lm_loss, example_args=example)
    except Exception as err:
        return {"host": this_host(), "error": f"{type(err).__name__}: {err}"}
    return {"host": this_host(), "error": None}
