"""ZeRO++ (qwZ, hpZ, qgZ) and CPU offload on a pipeline stage's FSDP2 units.

`shard_options(config)` gives `fully_shard`'s `reshard_after_forward` and `offload_policy`;
`install(units, groups, config)` sets the custom collectives of `core.plus_comm` on every unit.

hpZ is FSDP2's integer `reshard_after_forward=k`: after forward each rank keeps 1/k of the
weights (the secondary copy) and backward gathers over those k consecutive ranks, inside a
node. Where it acts:
- FSDP alone, and torch's pipeline schedules with `reshard_after_forward=True`: FSDP reshards to
  the secondary copy after every forward;
- `schedule="zeropp"`: the schedule releases a chunk's weights itself; a release after a block of
  forwards whose chunk will run backward later keeps the secondary copy (`core._torch_private.
  UnitScheduleRuntime`);
- torch's pipeline schedules without resharding (their default) gather once per step and never in
  backward: hpZ has nothing to do there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy

from lightning_zeropp.core._torch_private import defer_post_forward_reshard, fsdp_unit_shards
from lightning_zeropp.core.config import ZeroPPConfig
from lightning_zeropp.core.plus_comm import (
    HierarchicalReduceScatter,
    NodeGroups,
    QuantizedAllGather,
)
from lightning_zeropp.core.quant import BITS, Segment

__all__ = ["install", "node_groups", "segments_of", "shard_options", "uses_custom_comms"]


def uses_custom_comms(config: ZeroPPConfig) -> bool:
    return config.quantized_weights is not None or config.quantized_gradients is not None


def shard_options(config: ZeroPPConfig, device_type: str) -> dict[str, Any]:
    """`fully_shard` keyword arguments for the resharding and offload settings."""
    reshard: bool | int = bool(config.reshard_after_forward)
    k = config.hpz_partition_size
    if k is not None and k < config.dp_shard_size and (reshard or config.schedule == "zeropp"):
        reshard = k
    policy: OffloadPolicy = OffloadPolicy()
    if config.cpu_offload:
        policy = CPUOffloadPolicy(pin_memory=device_type == "cuda")
    return {"reshard_after_forward": reshard, "offload_policy": policy}


def node_groups(mesh: DeviceMesh, config: ZeroPPConfig, timeout: Any = None) -> NodeGroups | None:
    """The in-node and cross-node subgroups of every dp_shard group (collective: all ranks)."""
    if not uses_custom_comms(config) or config.dp_shard_size == 1:
        return None
    shard_axis = mesh.mesh_dim_names.index("dp_shard")
    ranks = mesh.mesh.movedim(shard_axis, -1).reshape(-1, config.dp_shard_size).tolist()
    return NodeGroups(ranks, config.node_size, timeout)


def segments_of(unit: FSDPModule) -> list[Segment]:
    """A unit's parameter shards as codec segments; 1-D parameters are not quantized."""
    segments, offset = [], 0
    for numel, ndim in fsdp_unit_shards(unit):
        segments.append(Segment(offset, numel, quantize=ndim >= 2))
        offset += numel
    return segments


def install(units: Iterable[FSDPModule], groups: NodeGroups | None, config: ZeroPPConfig) -> None:
    """Set the custom collectives (and hpZ's deferred reshard under ZeroPP) on every unit."""
    units = list(units)
    if config.schedule == "zeropp" and config.hpz_partition_size is not None:
        for unit in units:
            defer_post_forward_reshard(unit)
    if groups is None:
        return
    block = config.quant_block_size
    for unit in units:
        segments = segments_of(unit)
        if not segments:
            continue
        if config.quantized_weights is not None:
            bits = BITS.get(config.quantized_weights)
            unit.set_custom_all_gather(QuantizedAllGather(segments, groups, bits, block))
        if config.quantized_gradients is not None:
            bits = BITS.get(config.quantized_gradients)
            comm = HierarchicalReduceScatter(
                segments, groups, bits, block, error_feedback=config.gradient_error_feedback
            )
            unit.set_custom_reduce_scatter(comm)
            unit.set_force_sum_reduction_for_comms(True)
