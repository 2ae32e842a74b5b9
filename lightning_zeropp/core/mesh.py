"""The ("pp", "dp_replicate", "dp_shard") device mesh and the ranks a front needs from it.

Mesh positions are laid out pp-major: `dp_shard` is the fastest-varying axis, so the positions
that shard one model chunk are consecutive, and pipeline stages sit across nodes. With
`cp_size > 1` a fourth axis "cp" varies fastest of all (a sequence's ranks sit together, as
torchtitan lays them out), and FSDP shards over dp_shard x cp flattened into one axis.
Positions are filled with the ranks in host order (`core.hosts`): each host's ranks are
consecutive whatever order the launcher numbered them in, so every dp_shard x cp group sits
on one host.

Right after its groups exist, every pipeline link is exercised once (`core.links`), so a broken
one is named at setup. Every group the library creates gets the default (world) group's timeout,
the one given to `init_process_group`: torch would give them its own default (30 min for gloo, 10
for NCCL), so a rank blocked on a lost peer would wait that long whatever the job asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_zeropp.core._torch_private import flatten_mesh, group_timeout, mesh_group_options
from lightning_zeropp.core.hosts import Placement, check_node_size, gather_placement
from lightning_zeropp.core.links import check_links, link_pairs
from lightning_zeropp.core.settings.layout import ZeroPPLayout

__all__ = [
    "ParallelDims",
    "build_mesh",
    "build_partition_mesh",
    "describe_rank",
    "mesh_coordinates",
    "world_timeout",
]

MESH_AXES = ("pp", "dp_replicate", "dp_shard")
CP_AXIS = "cp"  # appended to MESH_AXES when cp_size > 1
SHARD_CP_AXIS = "dp_shard_cp"  # dp_shard x cp flattened: what FSDP shards over under CP


@dataclass(frozen=True)
class ParallelDims:
    """The mesh plus the derived ranks and groups every layer of the library asks for."""

    mesh: DeviceMesh
    config: ZeroPPLayout
    placement: Placement | None = None  # where each rank runs, and the order the mesh holds
    shard_cp: DeviceMesh | None = None  # dp_shard x cp flattened (torch wants it kept, not sliced)

    @property
    def pp_rank(self) -> int:
        return self.mesh.get_local_rank("pp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("pp")

    @property
    def dp_mesh(self) -> DeviceMesh:
        """Mesh FSDP shards over: 1-D over dp_shard (x cp), or 2-D (HSDP) when replicas > 1."""
        shard = SHARD_CP_AXIS if self.config.cp_size > 1 else "dp_shard"
        if self.config.dp_replicate_size > 1:
            return self.mesh["dp_replicate", shard]
        return self.shard_cp if self.shard_cp is not None else self.mesh[shard]

    @property
    def dp_rank(self) -> int:
        """Index of this rank's data shard: all stages of one pipeline see the same batch."""
        shard = self.mesh.get_local_rank("dp_shard")
        return self.mesh.get_local_rank("dp_replicate") * self.config.dp_shard_size + shard

    @property
    def dp_size(self) -> int:
        return self.config.dp_size

    @property
    def dp_groups(self) -> list[dist.ProcessGroup]:
        """The data-parallel axes' groups that have more than one rank."""
        assert self.mesh.mesh_dim_names is not None  # build_mesh names every axis
        return [
            self.mesh.get_group(axis)
            for axis in ("dp_replicate", "dp_shard")
            if self.mesh.size(self.mesh.mesh_dim_names.index(axis)) > 1
        ]

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The ranks one sequence is split over (None without context parallelism)."""
        return self.mesh.get_group(CP_AXIS) if self.config.cp_size > 1 else None

    @property
    def cp_rank(self) -> int:
        return self.mesh.get_local_rank(CP_AXIS) if self.config.cp_size > 1 else 0

    @property
    def grad_groups(self) -> list[dist.ProcessGroup]:
        """What a whole gradient or the step's loss is averaged over: the data-parallel groups
        and the CP group (each CP rank's loss is the mean over its part of the tokens)."""
        cp = [self.cp_group] if self.cp_group is not None else []
        return [*self.dp_groups, *cp]

    @property
    def grad_size(self) -> int:
        return self.config.dp_size * self.config.cp_size


def build_mesh(
    config: ZeroPPLayout, device_type: str, device: torch.device | None = None
) -> ParallelDims:
    """Build the 3-D mesh for a resolved config over the default process group, its ranks in
    host order, and check its pipeline links (`device`: this rank's, default the current one)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call init_process_group (with a timeout) first."
        )
    shape: tuple[int, ...] = (config.pp_size, config.dp_replicate_size, config.dp_shard_size)
    axes: tuple[str, ...] = MESH_AXES
    if config.cp_size > 1:
        shape, axes = (*shape, config.cp_size), (*axes, CP_AXIS)
    device = device if device is not None else device_for_rank(device_type)
    # a shard group is dp_shard x cp ranks (FSDP shards over both): one host holds each
    what = "dp_shard x cp" if config.cp_size > 1 else "dp_shard"
    placement = gather_placement(config.dp_shard_size * config.cp_size, str(device), what)
    if _node_groups(config):
        check_node_size(placement, config.node_size)
    mesh = _mesh(device_type, placement.order, shape, axes)
    shard_cp = None
    if config.cp_size > 1:
        timeout = world_timeout()
        flat = mesh_group_options(device_type, timeout) if timeout is not None else None
        shard_cp = flatten_mesh(mesh["dp_shard", CP_AXIS], SHARD_CP_AXIS, flat)
    if config.pp_size > 1:  # a broken pipeline link named now, not as a hang mid-step
        pairs = link_pairs(config.schedule, config.pp_size, config.num_chunks)
        check_links(mesh.get_group("pp"), pairs, device, placement.hosts)
    return ParallelDims(mesh=mesh, config=config, placement=placement, shard_cp=shard_cp)


def _node_groups(config: ZeroPPLayout) -> bool:
    """Whether the settings build groups from `node_size` (ZeRO++'s hpZ, qwZ, qgZ)."""
    return any(
        getattr(config, name, None) is not None
        for name in ("hpz_partition_size", "quantized_weights", "quantized_gradients")
    )


def _mesh(
    device_type: str, order: Sequence[int], shape: tuple[int, ...], names: tuple[str, ...]
) -> DeviceMesh:
    """A mesh holding the ranks `order` (row-major) in `shape`, every axis's groups created by
    every rank in one order (torch's) with the world's timeout."""
    override = None
    if (timeout := world_timeout()) is not None:
        # One options object per axis: NCCL's group creation writes the group's ranks into it.
        options = tuple(mesh_group_options(device_type, timeout) for _ in names)
        override = tuple((None, o) for o in options) if None not in options else None
    if tuple(order) == tuple(range(len(order))):  # torch's own layout: its fast path
        by_name: dict[int | str, Any] | None = None
        if override is not None:
            by_name = dict(zip(names, (o for _, o in override), strict=True))
        return init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=by_name)
    ranks = torch.tensor(list(order), dtype=torch.int).view(shape)
    return DeviceMesh(device_type, ranks, mesh_dim_names=names, backend_override=override)


def build_partition_mesh(
    size: int, device_type: str, order: Sequence[int] | None = None
) -> DeviceMesh:
    """A (world / size, size) mesh: dimension "hpz" groups `size` consecutive mesh positions
    (hpZ's small partitions, `core.shard.plus`; `order`: the main mesh's ranks, flattened, so a
    partition lies inside a shard group and a host), created by every rank alike with the
    world's timeout."""
    world = dist.get_world_size()
    order = list(range(world)) if order is None else list(order)
    return _mesh(device_type, order, (world // size, size), ("hpz_replicate", "hpz"))


def world_timeout() -> timedelta | None:
    """The default process group's timeout, for the groups the library creates (None: unknown,
    and they get torch's default)."""
    return group_timeout(dist.group.WORLD) if dist.is_initialized() else None


def describe_rank(
    mesh: DeviceMesh | None = None, stage_ids: Sequence[int] = (), rank: int | None = None
) -> str:
    """A rank's name for messages: 'rank 3 (pipeline stage 1, dp_shard 1)'; this rank's unless
    `rank` is given (then `stage_ids` are that rank's).

    Names the stages given, then the rank's coordinate on every mesh axis longer than one
    (the "pp" coordinate only when no stages are given).
    """
    rank = dist.get_rank() if rank is None else rank
    coords = mesh_coordinates(mesh, rank) if mesh is not None else {}
    parts = []
    if stage_ids:
        plural = "s" if len(stage_ids) > 1 else ""
        parts.append(f"pipeline stage{plural} " + " and ".join(str(s) for s in stage_ids))
    if mesh is not None:
        for dim, name in enumerate(mesh.mesh_dim_names or ()):
            if mesh.size(dim) > 1 and not (name == "pp" and stage_ids) and name in coords:
                parts.append(f"{name} {coords[name]}")
    return f"rank {rank}" + (f" ({', '.join(parts)})" if parts else "")


def mesh_coordinates(mesh: DeviceMesh, rank: int) -> dict[str, int]:
    """`rank`'s coordinate on each named axis of `mesh` (empty when it is not in the mesh)."""
    where = (mesh.mesh == rank).nonzero()
    if not len(where):
        return {}
    return dict(zip(mesh.mesh_dim_names or (), where[0].tolist(), strict=True))


def device_for_rank(device_type: str) -> torch.device:
    """This process's device: its local CUDA device, or the CPU."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)
