"""What a counted call's process group is called: the mesh axis it spans (`mesh_axis_namer`), and
a `CommCounter` summary flattened into per-kind, per-axis metrics (`flatten_summary`).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from lightning_zeropp.core.measure.comm import KINDS, PLUS_AXES, AxisNamer

__all__ = ["flatten_summary", "mesh_axis_namer"]


def mesh_axis_namer(mesh: DeviceMesh) -> AxisNamer:
    """Name a process group by the axis of `mesh` it spans: "pp", "dp_shard", ... or "world"/"other".

    A group is matched by identity with `mesh.get_group(axis)` first, then by its ranks, trying
    axes of size > 1 before size-1 ones. DeviceMesh reuses the default group for an axis that spans
    every rank, so the default group (`None`) is named by that axis when there is one; a group
    matching no axis is "world" if it spans every rank, else one of `PLUS_AXES` by its
    description, else "other".
    """
    axes = list(mesh.mesh_dim_names or ())
    groups = {axis: mesh.get_group(axis) for axis in axes}
    ranks = {axis: dist.get_process_group_ranks(g) for axis, g in groups.items()}
    axes.sort(key=lambda a: len(ranks[a]) == 1)  # stable: mesh order within each size class
    world = list(range(dist.get_world_size()))
    cache: dict[ProcessGroup | None, str] = {}

    def name(group: ProcessGroup | None) -> str:
        group = group if group is not None else dist.group.WORLD
        if group not in cache:
            found = next((a for a in axes if groups[a] is group), None)
            if found is None:
                group_ranks = dist.get_process_group_ranks(group)
                found = next((a for a in axes if ranks[a] == group_ranks), None)
                desc = (getattr(group, "group_desc", "") or "").removeprefix("mesh_")
                plus = desc if desc in PLUS_AXES else "other"
                found = found or ("world" if sorted(group_ranks) == world else plus)
            cache[group] = found
        return cache[group]

    return name


def flatten_summary(
    summary: dict[str, dict[str, dict[str, int]]], axes: list[str], prefix: str = "comm"
) -> dict[str, float]:
    """`summary()` as flat metrics `{prefix}/{kind}/{axis}/count|bytes`, with every kind in
    `KINDS` and every axis in `axes` present (zeros included), in a fixed order."""
    out: dict[str, float] = {}
    for kind in KINDS:
        for axis in axes:
            stats = summary.get(kind, {}).get(axis, {})
            out[f"{prefix}/{kind}/{axis}/count"] = float(stats.get("count", 0))
            out[f"{prefix}/{kind}/{axis}/bytes"] = float(stats.get("bytes", 0))
    return out
