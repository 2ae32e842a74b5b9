"""An emulated cluster on one machine: each node a Linux network namespace, links rate-limited.

Every node is a network namespace holding its ranks. Nodes reach each other through a veth pair
into a hub namespace with a bridge; a `tc` token bucket (`tbf`) on both ends of each pair limits
what a node sends and receives (the inter-node link, both directions), and one on the node's
loopback limits traffic between its own ranks (NVLink), which the kernel routes over `lo`. gloo
binds to the node's veth (`GLOO_SOCKET_IFNAME`), so every rank's address is its node's.

Needs root, `ip` and `tc` with `tbf` (`netem` is not needed). `unavailable()` says why not, so a
benchmark can say so and skip. Names carry a per-run tag, and everything is deleted on exit
(deleting a namespace deletes its veth ends).

Byte counters (`counters()`) come from the kernel: what crossed each node's link (its veth's
transmit bytes) and what stayed inside it (its loopback's), TCP/IP headers included.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Self

__all__ = ["EmulatedCluster", "Namespaces", "unavailable"]


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be used here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"lzpp_probe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up")
        _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
             "rate", "100mbit", "burst", "64kb", "latency", "100ms")  # fmt: skip
    except RuntimeError as err:
        return f"network namespaces or tbf unavailable: {err}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Namespaces:
    """What the emulated clusters share: a hub namespace with a bridge, member namespaces each
    joined to it by a veth pair, and every namespace made deleted on exit (in reverse; deleting
    a namespace deletes its veth ends). A subclass holds `tag` and `_made` and defines
    `_create`."""

    tag: str
    _made: list[str]

    def __enter__(self) -> Self:
        try:
            self._create()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()

    def _create(self) -> None:
        raise NotImplementedError

    def _add_hub(self) -> str:
        hub = f"lzpp{self.tag}hub"
        _run("ip", "netns", "add", hub)
        self._made.append(hub)
        _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", hub, "link", "set", "br0", "up")
        return hub

    def _add_member(self, hub: str, ns: str, dev: str, peer: str, address: str) -> None:
        """Namespace `ns` with loopback up and `dev` at `address`, whose veth peer `peer` is a
        port of the hub's bridge."""
        _run("ip", "netns", "add", ns)
        self._made.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "link", "add", dev, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", dev, "netns", ns)
        _run("ip", "link", "set", peer, "netns", hub)
        _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
        _run("ip", "-n", ns, "link", "set", dev, "up")
        _run("ip", "-n", hub, "link", "set", peer, "master", "br0")
        _run("ip", "-n", hub, "link", "set", peer, "up")


@dataclass
class EmulatedCluster(Namespaces):
    """`nodes` namespaces of `ranks_per_node` ranks; link rates in Mbit/s (None: unlimited)."""

    nodes: int
    ranks_per_node: int
    inter_mbit: float | None
    intra_mbit: float | None = None
    tag: str = field(default_factory=lambda: str(os.getpid() % 100000))
    _made: list[str] = field(default_factory=list)

    def ns(self, node: int) -> str:
        return f"lzpp{self.tag}n{node}"

    def veth(self, node: int) -> str:
        return f"v{self.tag}n{node}"  # at most 15 characters

    def address(self, node: int) -> str:
        return f"10.99.0.{node + 1}"

    def _create(self) -> None:
        hub = self._add_hub()
        for node in range(self.nodes):
            ns, dev, peer = self.ns(node), self.veth(node), f"h{self.tag}n{node}"
            self._add_member(hub, ns, dev, peer, self.address(node))
            if self.inter_mbit is not None:
                self._limit(ns, dev, self.inter_mbit)  # what the node sends
                self._limit(hub, peer, self.inter_mbit)  # what it receives
            if self.intra_mbit is not None:
                self._limit(ns, "lo", self.intra_mbit)

    @staticmethod
    def _limit(ns: str, dev: str, mbit: float) -> None:
        # A bucket of at least one 64 KiB TCP burst; a queue of about a second, so TCP sees
        # delay rather than drops at these low rates.
        burst = max(64 * 1024, int(mbit * 1e6 / 8 / 100))
        limit = max(int(mbit * 1e6 / 8), 4 * burst)
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
             "rate", f"{mbit}mbit", "burst", str(burst), "limit", str(limit))  # fmt: skip

    def cut(self, node: int) -> None:
        """Partition: take down the hub's end of `node`'s link (packets to and from the node are
        dropped; its sockets stay open, as behind a failed switch)."""
        _run("ip", "-n", f"lzpp{self.tag}hub", "link", "set", f"h{self.tag}n{node}", "down")

    # ------------------------------------------------------------------ ranks
    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def command_prefix(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(self.node_of(rank))]

    def env(self, rank: int) -> dict[str, str]:
        node = self.node_of(rank)
        return {
            "MASTER_ADDR": self.address(0),
            "GLOO_SOCKET_IFNAME": self.veth(node),
            "LOCAL_RANK": str(rank % self.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            "NODE_RANK": str(node),
        }

    def counters(self) -> dict[str, int]:
        """Bytes sent so far: over every node's link ("cross_node") and loopback ("in_node")."""
        out = {"cross_node": 0, "in_node": 0}
        for node in range(self.nodes):
            for key, dev in (("cross_node", self.veth(node)), ("in_node", "lo")):
                path = f"/sys/class/net/{dev}/statistics/tx_bytes"
                out[key] += int(_run("ip", "netns", "exec", self.ns(node), "cat", path))
        return out
