"""ZeRO++ on gloo ranks standing in for nodes: training numbers and the traffic by reach."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from lightning_zeropp import launch_layout
from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from lightning_zeropp.core._torch_private import fsdp_unit_shards, offload_policies
from lightning_zeropp.core.measure.comm import CommCounter
from lightning_zeropp.core.measure.traffic import NodeTraffic
from tests.distributed.common import GLOBAL_BATCH, MODEL, lm_loss, make_batches, make_model
from tests.distributed.core_scenarios import _full, _rows


def train(cases: list[dict[str, Any]], steps: int = 3, lr: float = 0.5) -> dict[str, Any]:
    """Each case: {"id", "layout"}; SGD for `steps` on the shared data, the last step counted."""
    return {case["id"]: _train(case["layout"], steps, lr) for case in cases}


def _train(layout: dict[str, Any], steps: int, lr: float) -> dict[str, Any]:
    config = ZeroPPConfig(**layout).resolve(dist.get_world_size())
    micro = GLOBAL_BATCH // config.dp_size // config.num_microbatches
    example = (torch.zeros(micro, MODEL.seq_len, dtype=torch.long),)
    engine = ZeroPPEngine(
        make_model(), launch_layout(config), loss_fn=lm_loss, example_args=example
    )
    opt = torch.optim.SGD(engine.parameters(), lr=lr)
    traffic = NodeTraffic(engine.dims.mesh, config.node_size)
    losses, summary = [], {}
    batches = make_batches(steps)
    for step, (x, y) in enumerate(batches):
        rows = _rows(engine, GLOBAL_BATCH)
        if step == steps - 1:
            with CommCounter(traffic) as comm:
                loss = engine.train_step(x[rows], target=y[rows])
            summary = comm.summary()
        else:
            loss = engine.train_step(x[rows], target=y[rows])
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    # The stages' modules: with several stages per rank, engine.module merges their trees.
    units = [m for s in engine._stage_modules for m in s.modules() if isinstance(m, FSDPModule)]
    return {
        "losses": losses,
        "params": {n: _full(p) for n, p in engine.module.named_parameters()},
        "summary": summary,
        "shapes": traffic.shapes,
        "sent": traffic.sent(summary),
        "units": [fsdp_unit_shards(u) for u in units if fsdp_unit_shards(u)],
        "offloaded": [
            type(p).__name__ for u in units for p in offload_policies(u) if fsdp_unit_shards(u)
        ],
    }


def reduce_scatter_direct(node_size: int, calls: int, block: int = 32) -> dict[str, Any]:
    """qgZ's comm called as FSDP calls it, on fixed inputs: every rank's input is the same each
    call, so the exact output of every call is known. Segments: a 2-D shard of 96 elements with
    outliers, then a 1-D shard of 8 (unquantized)."""
    from lightning_zeropp.core.shard.plus_comm import HierarchicalReduceScatter, NodeGroups
    from lightning_zeropp.core.shard.quant import BITS, Segment

    world, rank = dist.get_world_size(), dist.get_rank()
    groups = NodeGroups([list(range(world))], node_size)
    segments = [Segment(0, 96, True), Segment(96, 8, False)]
    width = 104
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(world, width, generator=g)
    x[:, ::17] *= 20.0
    # A row's position says where it must go: row j (rank j's partition) carries j * 1000 + rank.
    x[:, 96] = torch.arange(world) * 1000.0 + rank
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x)
    exact = sum(gathered)[rank]
    out: dict[str, Any] = {"exact": exact}
    for mode in ("fp", "int8", "int4", "int4-ef"):
        bits = BITS.get(mode.removesuffix("-ef"))
        comm = HierarchicalReduceScatter(
            segments, groups, bits, block, error_feedback=mode.endswith("-ef")
        )
        outputs = []
        for _ in range(calls):
            output = torch.empty(width)
            comm(output, x.clone().view(-1), dist.group.WORLD, dist.ReduceOp.SUM)
            outputs.append(output)
        out[mode] = torch.stack(outputs)
    return out


def gather_direct() -> dict[str, Any]:
    """One FSDP unit gathered through qwZ's comm: an unevenly sharded matrix (5 rows over the
    ranks), a 3-element vector, and, in a second unit, two dtypes (FSDP hands those over as
    bytes). Returns each unit's gathered parameters next to the originals."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_zeropp.core.shard.plus import segments_of
    from lightning_zeropp.core.shard.plus_comm import NodeGroups, QuantizedAllGather

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    groups = NodeGroups([list(range(world))], node_size=1)
    torch.manual_seed(0)
    uneven = nn.Module()
    uneven.weight = nn.Parameter(torch.randn(5, 3) * 10.0)
    uneven.bias = nn.Parameter(torch.randn(3))
    mixed = nn.Module()
    mixed.a = nn.Parameter(torch.randn(4, 4))
    # Frozen, in another dtype (FSDP2 needs one dtype among trainable parameters only).
    mixed.b = nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16), requires_grad=False)
    originals = {
        name: {n: p.detach().clone() for n, p in m.named_parameters()}
        for name, m in (("uneven", uneven), ("mixed", mixed))
    }
    out: dict[str, Any] = {"originals": originals, "gathered": {}}
    for name, module in (("uneven", uneven), ("mixed", mixed)):
        fully_shard(module, mesh=mesh)
        module.set_custom_all_gather(QuantizedAllGather(segments_of(module), groups, 8, 4))
        module.unshard()
        out["gathered"][name] = {n: p.detach().clone() for n, p in module.named_parameters()}
        module.reshard()
    return out
