"""The ("pp", "dp_replicate", "dp_shard") device mesh and the ranks a front needs from it.

Ranks are laid out pp-major: `dp_shard` is the fastest-varying axis, so the ranks that shard one
model chunk are consecutive (inside a node), and pipeline stages sit across nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_zeropp.core.config import ZeroPPConfig

__all__ = ["ParallelDims", "build_mesh"]

MESH_AXES = ("pp", "dp_replicate", "dp_shard")


@dataclass(frozen=True)
class ParallelDims:
    """The mesh plus the derived ranks and groups every layer of the library asks for."""

    mesh: DeviceMesh
    config: ZeroPPConfig

    @property
    def pp_rank(self) -> int:
        return self.mesh.get_local_rank("pp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("pp")

    @property
    def dp_mesh(self) -> DeviceMesh:
        """Mesh FSDP shards over: 1-D over dp_shard, or 2-D (HSDP) when replicas > 1."""
        if self.config.dp_replicate_size > 1:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"]

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
        return [
            self.mesh.get_group(axis)
            for axis in ("dp_replicate", "dp_shard")
            if self.mesh.size(self.mesh.mesh_dim_names.index(axis)) > 1
        ]


def build_mesh(config: ZeroPPConfig, device_type: str) -> ParallelDims:
    """Build the 3-D mesh for a resolved config over the default process group."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call init_process_group (with a timeout) first."
        )
    shape = (config.pp_size, config.dp_replicate_size, config.dp_shard_size)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
    return ParallelDims(mesh=mesh, config=config)


def device_for_rank(device_type: str) -> torch.device:
    """This process's device: its local CUDA device, or the CPU."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)
