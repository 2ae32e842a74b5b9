"""ZeRO++ (qwZ, hpZ, qgZ) and CPU offload on a pipeline stage's FSDP2 units.

`Plus.build(mesh, config)` creates the process groups ZeRO++ needs (collective: every rank, in
one order); `plus.sharding()` is the context `fully_shard` runs in, `plus.options()` its
`reshard_after_forward` and `offload_policy`, and `plus.install(units)` sets the custom
collectives of `core.shard.plus_comm` on every unit.

hpZ is FSDP2's integer `reshard_after_forward=k`: after forward each rank keeps 1/k of the
weights (the secondary copy) and backward gathers over those k consecutive ranks, inside a
node. Where it acts:
- FSDP alone, and torch's pipeline schedules with `reshard_after_forward=True`: FSDP reshards to
  the secondary copy after every forward;
- `schedule="zeropp"`: the schedule releases a chunk's weights itself; a release after a block of
  forwards whose chunk will run backward later keeps the secondary copy (`schedule.zeropp.lower`,
  run by `core.schedule.runtime.UnitScheduleRuntime`);
- torch's pipeline schedules without resharding (their default) gather once per step and never in
  backward: hpZ has nothing to do there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy

from lightning_zeropp.core._torch_private import (
    defer_post_forward_reshard,
    fsdp_unit_shards,
    post_forward_mesh,
)
from lightning_zeropp.core.mesh import build_partition_mesh, world_timeout
from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.settings.plus import hpz_size, shard_group_size
from lightning_zeropp.core.shard.plus_comm import (
    HierarchicalReduceScatter,
    NodeGroups,
    QuantizedAllGather,
)
from lightning_zeropp.core.shard.quant import BITS, Segment

__all__ = ["Plus", "segments_of"]


@dataclass
class Plus:
    """What a run's ZeRO++ and offload settings need at sharding time."""

    config: ZeroPPLayout
    device_type: str
    groups: NodeGroups | None = None  # qwZ / qgZ: every shard group split into nodes
    partition_mesh: DeviceMesh | None = None  # hpZ: the small partitions

    @classmethod
    def build(cls, mesh: DeviceMesh, config: ZeroPPLayout) -> Plus:
        """Create the groups the settings need (collective: every rank calls it)."""
        plus = cls(config, mesh.device_type)
        timeout = world_timeout()
        # Mesh positions, not rank numbers, are what lie in one node: the mesh holds the ranks
        # in host order (`core.hosts`), whatever order the launcher numbered them in.
        order = mesh.mesh.flatten().tolist()
        shard = shard_group_size(config)
        if _custom_comms(config) and shard > 1:
            assert mesh.mesh_dim_names is not None  # the ZeroPP mesh names every axis
            # FSDP's shard groups: dp_shard (x cp, which varies fastest: under context
            # parallelism weights are sharded over both axes flattened)
            axes = [
                mesh.mesh_dim_names.index(a) for a in ("dp_shard", "cp") if a in mesh.mesh_dim_names
            ]
            ranks = mesh.mesh.movedim(axes, list(range(-len(axes), 0))).reshape(-1, shard)
            position = {rank: i for i, rank in enumerate(order)}
            plus.groups = NodeGroups(ranks.tolist(), config.node_size, timeout, position)
        if plus.hpz_size is not None:
            plus.partition_mesh = build_partition_mesh(plus.hpz_size, mesh.device_type, order)
        return plus

    @property
    def hpz_size(self) -> int | None:
        """k when hpZ is on and smaller than the shard group (k = the group is plain ZeRO-3)."""
        return hpz_size(self.config)

    def sharding(self) -> contextlib.AbstractContextManager[None]:
        return post_forward_mesh(self.partition_mesh)

    def options(self) -> dict[str, Any]:
        """`fully_shard` keyword arguments for the resharding and offload settings."""
        config = self.config
        reshard: bool | int = bool(config.reshard_after_forward)
        if self.hpz_size is not None and (reshard or config.schedule == "zeropp"):
            reshard = self.hpz_size
        policy: OffloadPolicy = OffloadPolicy()
        if config.cpu_offload:
            policy = CPUOffloadPolicy(pin_memory=self.device_type == "cuda")
        return {"reshard_after_forward": reshard, "offload_policy": policy}

    def install(self, units: Iterable[FSDPModule]) -> None:
        """Set the custom collectives (and hpZ's deferred reshard under ZeroPP) on every unit."""
        units = list(units)
        config = self.config
        if config.schedule == "zeropp" and self.hpz_size is not None:
            for unit in units:
                defer_post_forward_reshard(unit)
        if self.groups is None:
            return
        for unit in units:
            if segments := segments_of(unit):
                self._install(unit, segments)

    def _install(self, unit: FSDPModule, segments: list[Segment]) -> None:
        config, block = self.config, self.config.quant_block_size
        assert self.groups is not None  # install() calls this only when groups were built
        if config.quantized_weights is not None:
            bits = BITS.get(config.quantized_weights)
            wire = torch.bfloat16 if config.quantized_weights == "bf16" else None
            comm = QuantizedAllGather(segments, self.groups, bits, block, wire_dtype=wire)
            # The comms duck-type torch's AllGather/ReduceScatter (their bases are private names).
            unit.set_custom_all_gather(comm)  # type: ignore[arg-type]
        if config.quantized_gradients is not None:
            bits = BITS.get(config.quantized_gradients)
            scatter = HierarchicalReduceScatter(
                segments, self.groups, bits, block, error_feedback=config.gradient_error_feedback
            )
            unit.set_custom_reduce_scatter(scatter)  # type: ignore[arg-type]
            unit.set_force_sum_reduction_for_comms(True)


def _custom_comms(config: ZeroPPLayout) -> bool:
    return config.quantized_weights is not None or config.quantized_gradients is not None


def segments_of(unit: FSDPModule) -> list[Segment]:
    """A unit's parameter shards as codec segments; 1-D parameters are not quantized."""
    segments, offset = [], 0
    for numel, ndim in fsdp_unit_shards(unit):
        segments.append(Segment(offset, numel, quantize=ndim >= 2))
        offset += numel
    return segments
