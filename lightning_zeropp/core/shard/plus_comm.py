"""ZeRO++'s collectives as FSDP2 custom comms: qwZ's all-gather and qgZ's two-hop reduce-scatter.

FSDP2 calls a unit's comm with its flat buffer: each rank's part is the padded shard of every
parameter of the unit, concatenated ("segments", `core.shard.quant`). Both comms pack rows with a
`BlockCodec`, so blocks follow parameter boundaries and 1-D parameters travel unquantized.

- `QuantizedAllGather`: each rank packs its own part (INT8 + fp32 scales; or every value as
  `wire_dtype`, e.g. bf16 weights for fp32 compute), the packed rows are
  all-gathered, and every rank, owner included, unpacks every row into the output, so all ranks
  compute with the same weights. A gather on a group other than the unit's shard group (hpZ's
  in-node backward gather of the already-dequantized secondary copy) and a mixed-dtype unit
  (FSDP hands it uint8 bytes) pass through as a plain all-gather.
- `HierarchicalReduceScatter` (SUM only: FSDP divides afterwards, `set_force_sum_reduction_for_
  comms`): the rows are reordered so that, after an all-to-all inside the node, local rank i holds
  its node's contributions to every rank with local index i; those are summed in fp32, packed
  again, and an all-to-all between the ranks of local index i in every node leaves each rank its
  own partition, summed in fp32. Every hop moves packed bytes; every sum is in full precision.
  With error feedback, each hop adds the error its last packing left (times `error_decay`,
  LoCo's 0.8) before packing.

`NodeGroups` creates, on every rank in one order, the in-node and cross-node subgroups of every
shard group of the mesh (process-group creation is collective over the world).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_zeropp.core.shard.quant import BlockCodec, Segment

__all__ = ["HierarchicalReduceScatter", "NodeGroups", "QuantizedAllGather", "Split"]


@dataclass(frozen=True)
class Split:
    """One shard group seen from this rank: `nodes` x `local` ranks, its subgroups."""

    nodes: int
    local: int
    intra: ProcessGroup | None  # this rank's node's members of the group (None if local == 1)
    cross: ProcessGroup | None  # the members with this rank's local index (None if nodes == 1)


class NodeGroups:
    """Every shard group's split into nodes, keyed by the group's global ranks."""

    def __init__(
        self,
        shard_groups: Sequence[Sequence[int]],
        node_size: int,
        timeout: timedelta | None = None,
        position: Mapping[int, int] | None = None,
    ) -> None:
        me = dist.get_rank()
        self.node_size = node_size
        self._splits: dict[tuple[int, ...], Split] = {}
        for ranks in shard_groups:
            nodes = _by_node(ranks, node_size, position)
            local = len(nodes[0])
            intra = cross = None
            # Every rank creates every subgroup, in the same order, whether it belongs or not.
            if local > 1:
                for members in nodes:
                    pg = _new_group(members, timeout, "zeropp_plus_intra")
                    intra = pg if me in members else intra
            if len(nodes) > 1:
                for i in range(local):
                    members = [node[i] for node in nodes]
                    pg = _new_group(members, timeout, "zeropp_plus_cross")
                    cross = pg if me in members else cross
            if me in ranks:
                self._splits[tuple(ranks)] = Split(len(nodes), local, intra, cross)

    def split(self, group: ProcessGroup) -> Split | None:
        """The split of `group` if it is one of the shard groups this rank is in."""
        return self._splits.get(tuple(dist.get_process_group_ranks(group)))


def _by_node(
    ranks: Sequence[int], node_size: int, position: Mapping[int, int] | None = None
) -> list[list[int]]:
    """`ranks` split into nodes: `node_size` consecutive mesh positions (`position[rank]`; the
    rank itself when no mapping is given)."""
    nodes: dict[int, list[int]] = {}
    for r in ranks:
        nodes.setdefault((position[r] if position else r) // node_size, []).append(r)
    groups = list(nodes.values())
    if len({len(g) for g in groups}) != 1:
        raise ValueError(
            f"the shard group {list(ranks)} has unequal numbers of ranks per node "
            f"(node_size={node_size}); choose dp_shard_size and node_size so one divides the other."
        )
    return groups


def _new_group(members: list[int], timeout: timedelta | None, desc: str) -> ProcessGroup:
    return dist.new_group(members, timeout=timeout, group_desc=desc)


class _UnitComm:
    """What both comms hold: the unit's segments, the node split of its shard groups, the bit
    width (None: unquantized), the block size and the codec per buffer dtype (built once, not
    per call); FSDP allocates their buffers through them."""

    def __init__(
        self,
        segments: Sequence[Segment],
        groups: NodeGroups,
        bits: int | None,
        block: int,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        self.segments = list(segments)
        self.groups = groups
        self.bits = bits
        self.block = block
        self.wire_dtype = wire_dtype  # unquantized values travel as this (default: their own)
        self._codecs: dict[torch.dtype, BlockCodec] = {}

    def codec(self, dtype: torch.dtype) -> BlockCodec:
        """The codec for buffers of `dtype` (unquantized values travel as `wire_dtype`)."""
        if dtype not in self._codecs:
            wire = self.wire_dtype or dtype
            self._codecs[dtype] = BlockCodec(self.segments, wire, self.bits, self.block)
        return self._codecs[dtype]

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class QuantizedAllGather(_UnitComm):
    """qwZ for one FSDP unit: `segments` are its parameters' padded shards (see module doc); it
    takes `_UnitComm`'s arguments as they are."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if not input_tensor.is_floating_point() or self.groups.split(group) is None:
            return dist.all_gather_single(
                output_tensor, input_tensor, group=group, async_op=async_op
            )
        codec = self.codec(input_tensor.dtype)
        if codec.width_elements != input_tensor.numel():
            raise AssertionError(
                f"qwZ: FSDP's all-gather input has {input_tensor.numel()} elements, the unit's "
                f"parameter shards {codec.width_elements}"
            )
        # The input is a view into the output: pack it before anything is written there.
        packed = codec.encode(input_tensor.view(1, -1))
        gathered = packed.new_empty((group.size(), codec.width_bytes))
        dist.all_gather_single(gathered, packed, group=group)
        codec.decode(gathered, out=output_tensor.view(group.size(), -1))
        return None


class HierarchicalReduceScatter(_UnitComm):
    """qgZ for one FSDP unit (see module doc): a two-hop all-to-all of packed rows, SUM only."""

    def __init__(
        self,
        segments: Sequence[Segment],
        groups: NodeGroups,
        bits: int | None,
        block: int,
        error_feedback: bool = False,
        error_decay: float = 0.8,
    ) -> None:
        super().__init__(segments, groups, bits, block)
        self.error_feedback = error_feedback
        self.error_decay = error_decay
        self._errors: dict[str, torch.Tensor] = {}

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> dist.Work | None:
        if op != dist.ReduceOp.SUM:
            raise AssertionError(f"qgZ implements SUM only, FSDP asked for {op}")
        split = self.groups.split(group)
        if split is None:
            raise AssertionError(f"qgZ: {dist.get_process_group_ranks(group)} is no shard group")
        codec = self.codec(input_tensor.dtype)
        width = codec.width_elements
        if split.nodes * split.local * width != input_tensor.numel():
            raise AssertionError(
                f"qgZ: reduce-scatter input of {input_tensor.numel()} elements is not "
                f"{split.nodes * split.local} rows of the unit's {width}"
            )
        # Row (b, j) goes to local rank j of node b; regroup by j for the in-node hop.
        rows = input_tensor.view(split.nodes, split.local, width).transpose(0, 1)
        rows = rows.reshape(split.local * split.nodes, width)
        partial = self._hop("intra", rows, split.intra, split.local, codec)
        total = self._hop("cross", partial, split.cross, split.nodes, codec)
        output_tensor.copy_(total.view(-1))
        return None

    def _hop(
        self,
        name: str,
        rows: torch.Tensor,
        group: ProcessGroup | None,
        size: int,
        codec: BlockCodec,
    ) -> torch.Tensor:
        """All-to-all `rows` ([size x n, C], n rows per peer) packed; return the fp32 sum over
        the peers of what they sent, [n, C]."""
        if group is None:
            return rows.to(torch.float32)
        values = rows.to(torch.float32)
        if self.error_feedback:
            values = values + self._errors.get(name, 0.0)
        packed = codec.encode(values)
        if self.error_feedback:
            self._errors[name] = (values - codec.decode(packed)) * self.error_decay
        received = torch.empty_like(packed)
        dist.all_to_all_single(received, packed, group=group)
        decoded = codec.decode(received)
        return decoded.view(size, -1, codec.width_elements).sum(dim=0)
