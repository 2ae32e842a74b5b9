"""The layout of a run in words: what every run prints once at setup.

World and mesh sizes, schedule, micro-batches, chunks and unit size, the split, and each stage's
blocks, pipeline rank and parameter count (of the whole model, not this rank's shard); what the
stages were cut by, and each pipeline rank's share of the work when cut by cost; then the hosts,
and the host of each dp_shard group (`core.hosts`: the mesh holds the ranks in host order).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lightning_zeropp.core.settings.placement import rank_of_stage
from lightning_zeropp.core.split.cost import rank_loads

__all__ = ["describe_layout"]


def describe_layout(engine: Any) -> str:
    """Collective over the pipeline group (every rank calls it; every rank gets the text)."""
    cfg, dims = engine.config, engine.dims
    # DTensor parameters report their full shape: these are whole-stage counts.
    mine = {
        s: sum(p.numel() for p in m.parameters())
        for s, m in zip(engine.stage_ids, engine._stage_modules, strict=True)
    }
    parts: list[dict[int, int]] = [{} for _ in range(cfg.pp_size)]
    dist.all_gather_object(parts, mine, group=dims.pp_group)
    counts = {s: n for part in parts for s, n in part.items()}
    head = (
        f"ZeroPP layout: world {dist.get_world_size()} = pp {cfg.pp_size} x dp_replicate "
        f"{cfg.dp_replicate_size} x dp_shard {cfg.dp_shard_size}; schedule {cfg.schedule!r}, "
        f"{cfg.num_microbatches} micro-batches, {cfg.num_chunks} stage(s) per pipeline rank"
    )
    if cfg.unit_size is not None:
        head += f", unit size {cfg.unit_size}"
    lines = [head + f"; split {engine.split!r}"]
    plan = engine.plan
    if plan is not None and engine.num_stages > 1:
        lines.append(f"  stages cut by {plan.basis}")
    for stage in range(engine.num_stages):
        where = f"'{plan.container or '<root>'}'" if plan is not None else None
        blocks = (
            f"blocks {plan.ranges[stage].start}-{plan.ranges[stage].stop - 1} of {where}"
            if plan is not None
            else "the whole model"
        )
        rank = rank_of_stage(engine.style, stage, cfg.pp_size)
        lines.append(f"  stage {stage} (pp rank {rank}): {blocks}, {counts[stage]:,} parameters")
    lines.append(f"  total: {sum(counts.values()):,} parameters")
    if plan is not None and plan.costs is not None:
        starts = [r.start for r in plan.ranges]
        loads = rank_loads(plan.costs, starts, engine.style, cfg.pp_size)
        shares = ", ".join(f"{r} {x / sum(loads):.1%}" for r, x in enumerate(loads))
        lines.append(f"  each pp rank's share of the work (forward + backward FLOPs): {shares}")
    return "\n".join(lines + placement_lines(dims))


def placement_lines(dims: Any) -> list[str]:
    """The hosts and each dp_shard group's ranks and host(s), from the mesh and its placement."""
    placement = getattr(dims, "placement", None)
    if placement is None:
        return []
    counts = {h: placement.hosts.count(h) for h in placement.host_names}
    order = "as numbered" if placement.is_identity else "reordered by host"
    lines = [
        f"  hosts: {len(counts)} ({', '.join(f'{h}: {n} ranks' for h, n in counts.items())}); "
        f"mesh ranks {order}"
    ]
    if placement.group_hosts > 1:
        lines.append(
            f"  each dp_shard group spans {placement.group_hosts} whole hosts (dp_shard_size "
            "exceeds the ranks per host): its collectives cross the hosts' link"
        )
    mesh = dims.mesh.mesh
    group = dims.config.dp_shard_size * dims.config.cp_size  # FSDP's group: dp_shard x cp
    shards = mesh.reshape(mesh.shape[0], -1, group)  # (pp, replicas, dp_shard x cp)
    for pp in range(shards.shape[0]):
        groups = []
        for ranks in shards[pp].tolist():
            where = "+".join(dict.fromkeys(placement.hosts[r] for r in ranks))
            named = f"ranks {ranks}" if len(ranks) <= 8 else f"{len(ranks)} ranks"
            groups.append(f"{named} on {where}")
        lines.append(f"  pp rank {pp} dp_shard groups: " + "; ".join(groups))
    return lines
