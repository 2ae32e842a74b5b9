"""Where ranks are: each rank's host, and the rank order that puts every shard group on one host.

Launchers do not promise that rank numbers follow hosts: SLURM's cyclic distribution puts rank 0
on the first node and rank 1 on the second, torchrun's c10d rendezvous orders nodes its own way.
A mesh laid over `arange(world)` then puts each dp_shard group across nodes, and every FSDP
all-gather and reduce-scatter crosses the slow link, silently.

`host_order(hosts, group)` is a pure function of the host of each rank: the ranks grouped by host
(hosts in the order their first rank appears, ranks ascending inside a host), so each host's
ranks are consecutive and every `group` consecutive positions (a dp_shard group, an hpZ
partition) sit on one host. Numbering that already follows hosts gives the identity: nothing
changes for a block distribution or a single machine. A group larger than a host spans the
fewest whole hosts; a world that cannot be laid out so (a host whose rank count the group does
not divide) is refused, naming the hosts and their counts. A dimension added later (context
parallelism) composes by passing the product of the sizes that must stay on one host.

`gather_placement(group, device)` gathers the hosts once at setup (one all-gather of small
objects over the world) and returns the `Placement` every rank computes alike.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

__all__ = [
    "Placement",
    "PlacementError",
    "check_node_size",
    "gather_placement",
    "host_order",
    "this_host",
]


class PlacementError(ValueError):
    """The world's ranks cannot be laid out with every group on as few hosts as it needs."""


@dataclass(frozen=True)
class Placement:
    """The rank at each mesh position, and where each rank runs."""

    order: tuple[int, ...]  # order[i]: the rank at mesh position i (flattened, row-major)
    hosts: tuple[str, ...]  # hosts[r]: rank r's host name
    devices: tuple[str, ...] = ()  # devices[r]: rank r's device ("cuda:1", "cpu")
    group_hosts: int = 1  # hosts one group spans (more than 1 only when a group exceeds a host)

    @property
    def host_names(self) -> list[str]:
        """Hosts in the order of their first rank."""
        return list(dict.fromkeys(self.hosts))

    def node_of(self, rank: int) -> int:
        """Index of `rank`'s host in `host_names`."""
        return self.host_names.index(self.hosts[rank])

    @property
    def is_identity(self) -> bool:
        return self.order == tuple(range(len(self.order)))


def _counts(hosts: Sequence[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for host in hosts:
        counts[host] = counts.get(host, 0) + 1
    return counts


def host_order(hosts: Sequence[str], group: int, what: str = "dp_shard") -> Placement:
    """The ranks ordered so every `group` consecutive positions sit on one host (or, when a
    group is larger than a host, on the fewest whole hosts). `hosts[r]` is rank r's host;
    `what` names the group in the error. Raises `PlacementError` when that cannot be done."""
    world = len(hosts)
    if group < 1 or world % group:
        raise ValueError(f"group={group} must be a positive divisor of the world ({world}).")
    counts = _counts(hosts)
    rank_of_host = {host: i for i, host in enumerate(counts)}
    # Stable: ranks keep their relative order inside a host, hosts their first-rank order.
    order = tuple(sorted(range(world), key=lambda r: (rank_of_host[hosts[r]], r)))
    sizes = set(counts.values())
    if all(n % group == 0 for n in counts.values()):
        return Placement(order, tuple(hosts))
    if len(sizes) == 1 and group % (per_host := sizes.pop()) == 0:
        return Placement(order, tuple(hosts), group_hosts=group // per_host)
    listed = ", ".join(f"{host}: {n}" for host, n in counts.items())
    raise PlacementError(
        f"{what} groups of {group} ranks cannot each sit on one host, nor on whole hosts: the "
        f"world's {world} ranks are on {len(counts)} hosts with ({listed}) ranks. Choose "
        f"{what}_size dividing every host's rank count (or a multiple of an equal count), or "
        "launch the same number of processes on every host."
    )


def check_node_size(placement: Placement, node_size: int) -> None:
    """Refuse a `node_size` whose nodes (that many consecutive mesh positions: ZeRO++'s in-node
    groups and hpZ's partitions) are not the hosts the ranks run on."""
    if len(placement.host_names) < 2:
        return  # one machine: node_size may emulate nodes on it
    hosts = [placement.hosts[r] for r in placement.order]
    blocks = [hosts[i : i + node_size] for i in range(0, len(hosts), node_size)]
    if all(len(set(b)) == 1 for b in blocks):
        return
    counts = ", ".join(f"{h}: {placement.hosts.count(h)}" for h in placement.host_names)
    raise PlacementError(
        f"node_size={node_size} does not match the hosts the ranks run on ({counts} ranks): "
        "ZeRO++'s in-node groups (hpz_partition_size, quantized_weights/gradients) would cross "
        "hosts. Set node_size to the ranks per host (the launcher's LOCAL_WORLD_SIZE)."
    )


def this_host() -> str:
    """This process's host name (what `socket.gethostname` says: a UTS namespace's own)."""
    return socket.gethostname()


def gather_placement(group: int, device: str, what: str = "dp_shard") -> Placement:
    """Every rank's host and device, gathered once over the world, and `host_order` of them
    (collective: every rank calls it, and every rank computes the same placement or the same
    error)."""
    mine = (this_host(), device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        everyone = [mine]
    else:
        everyone = [mine] * dist.get_world_size()  # each entry overwritten by that rank's
        dist.all_gather_object(everyone, mine)
    placement = host_order([host for host, _ in everyone], group, what)
    return Placement(
        placement.order,
        placement.hosts,
        tuple(dev for _, dev in everyone),
        placement.group_hosts,
    )
