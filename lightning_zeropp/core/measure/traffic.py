"""Which of a rank's collective bytes leave its node: a group namer for `CommCounter`.

`NodeTraffic(mesh, node_size)` names each process group by what it is (a mesh axis, ZeRO++'s
`zeropp_plus_intra` / `zeropp_plus_cross` subgroups, `hpz` partitions, or "other") and by
where it reaches, from this rank: `dp_shard:x4` is a 4-rank group with members in another node,
`zeropp_plus_intra:in2` a 2-rank group inside this rank's node. A node is a host when the hosts
are given (`ParallelDims.placement.hosts`), else `node_size` consecutive ranks.

`sent(summary)` turns a `CommCounter` summary into the bytes this rank sends to other nodes and
inside its node, by the direct-exchange convention (what a collective must deliver, whatever
algorithm carries it): an all-gather sends this rank's input to every other member; a
reduce-scatter or all-to-all sends each other member its 1/n of the input; an all-reduce twice
that (reduce-scatter then all-gather); a broadcast 1/n per member; a send its message (to one
peer, counted as crossing if the group's other members do: exact for 2-rank pipeline groups).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from lightning_zeropp.core.measure.axes import mesh_axis_namer

__all__ = ["NodeTraffic"]


class NodeTraffic:
    """A `CommCounter` axis namer that records each named group's size and reach."""

    def __init__(
        self, mesh: DeviceMesh, node_size: int, hosts: Sequence[str] | None = None
    ) -> None:
        self._axis = mesh_axis_namer(mesh)
        self.node_size = node_size
        # Where ranks really are (`ParallelDims.placement.hosts`); else node_size consecutive
        # ranks make a node.
        self.hosts = list(hosts) if hosts is not None else None
        self.shapes: dict[str, tuple[int, int]] = {}  # name -> (members, members in other nodes)
        self._cache: dict[ProcessGroup | None, str] = {}

    def __call__(self, group: ProcessGroup | None) -> str:
        group = group if group is not None else dist.group.WORLD
        if group not in self._cache:
            axis = self._axis(group)
            ranks = dist.get_process_group_ranks(group)
            node = self._node(dist.get_rank())
            others = sum(1 for r in ranks if self._node(r) != node)
            name = f"{axis}:{'x' if others else 'in'}{len(ranks)}"
            self.shapes[name] = (len(ranks), others)
            self._cache[group] = name
        return self._cache[group]

    def _node(self, rank: int) -> str | int:
        return self.hosts[rank] if self.hosts is not None else rank // self.node_size

    def sent(self, summary: dict[str, dict[str, dict[str, int]]]) -> dict[str, float]:
        """{"cross_node": bytes, "in_node": bytes} this rank sent (see the module doc)."""
        out = {"cross_node": 0.0, "in_node": 0.0}
        for kind, axes in summary.items():
            for name, stats in axes.items():
                n, others = self.shapes.get(name, (1, 0))
                local = n - 1 - others
                for key, peers in (("cross_node", others), ("in_node", local)):
                    out[key] += stats["bytes"] * _share(kind, n, peers)
        return out


def _share(kind: str, n: int, peers: int) -> float:
    """Bytes sent to `peers` of the group's other members per byte this rank handed the call."""
    if n <= 1 or peers == 0:
        return 0.0
    if kind == "all_gather":
        return float(peers)
    if kind in ("reduce_scatter", "all_to_all", "broadcast"):
        return peers / n
    if kind == "all_reduce":
        return 2 * peers / n
    if kind in ("send", "send_recv"):
        return peers / (n - 1)
    return 0.0  # recv (counted by its sender), barrier
