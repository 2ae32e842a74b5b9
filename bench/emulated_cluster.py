"""An emulated GPU cluster's links on one machine: one network namespace per rank.

Each rank gets its own namespace and a veth pair into a hub namespace's bridge, so every byte
it sends or receives crosses its own pair. An `htb` qdisc on each end sorts traffic by the peer's
address: to and from ranks of the same emulated node at `intra_mbit` (NVLink), to and from the
others at `inter_mbit` (the node's network, one adapter per GPU as on a DGX). Rates are per rank
and per direction, as a GPU's links are; `bench/netns.py` instead puts a node's ranks in one
namespace, where they share one limit.

Needs root, `ip` and `tc` with `htb` and `u32` (`netns.unavailable()` checks the rest). Names
carry a per-run tag; everything is deleted on exit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from netns import Namespaces, _run

__all__ = ["RankCluster"]


@dataclass
class RankCluster(Namespaces):
    """`world` ranks in nodes of `ranks_per_node`; link rates in Mbit/s per rank and direction."""

    world: int
    ranks_per_node: int
    intra_mbit: float
    inter_mbit: float
    nice: int | None = None  # scheduling priority of the ranks (root may raise it: negative)
    tag: str = field(default_factory=lambda: str(os.getpid() % 100000))
    _made: list[str] = field(default_factory=list)

    def ns(self, rank: int) -> str:
        return f"lzpp{self.tag}r{rank}"

    def veth(self, rank: int) -> str:
        return f"v{self.tag}r{rank}"  # at most 15 characters

    def address(self, rank: int) -> str:
        return f"10.98.0.{rank + 1}"

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def _create(self) -> None:
        hub = self._add_hub()
        for rank in range(self.world):
            ns, dev, peer = self.ns(rank), self.veth(rank), f"h{self.tag}r{rank}"
            self._add_member(hub, ns, dev, peer, self.address(rank))
            mates = [
                self.address(r)
                for r in range(self.world)
                if r != rank and self.node_of(r) == self.node_of(rank)
            ]
            self._shape(ns, dev, mates, "dst")  # what the rank sends
            self._shape(hub, peer, mates, "src")  # what it receives

    def _shape(self, ns: str, dev: str, mates: list[str], direction: str) -> None:
        """htb on `dev`: traffic whose `direction` address is a node mate at the intra rate,
        the rest at the inter rate."""

        def tc(*args: str) -> None:
            _run("ip", "netns", "exec", ns, "tc", *args)

        tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
        for cls, mbit in (("1:10", self.intra_mbit), ("1:20", self.inter_mbit)):
            tc("class", "add", "dev", dev, "parent", "1:", "classid", cls, "htb",
               "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit", "quantum", "1514")  # fmt: skip
        for address in mates:
            tc("filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
               "u32", "match", "ip", direction, f"{address}/32", "flowid", "1:10")  # fmt: skip

    # ------------------------------------------------------------------ ranks
    def command_prefix(self, rank: int) -> list[str]:
        nice = ["nice", "-n", str(self.nice)] if self.nice is not None else []
        return ["ip", "netns", "exec", self.ns(rank), *nice]

    def env(self, rank: int) -> dict[str, str]:
        return {
            "MASTER_ADDR": self.address(0),
            "GLOO_SOCKET_IFNAME": self.veth(rank),
            "LOCAL_RANK": str(rank % self.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            "NODE_RANK": str(self.node_of(rank)),
        }
