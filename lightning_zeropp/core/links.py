"""The pipeline's links checked at setup: every send/receive pair exercised once, before a step.

A pipeline's point-to-point links are otherwise first used inside the first step, where a broken
link (a dead port, a firewall, a peer on the wrong interface) shows as a hang or a transport
timeout mid-step that names nobody. `check_links` sends one tiny tensor each way over every pair
of pipeline ranks that hand each other activations, right after the mesh's groups are created:
a link that fails is named (which ranks, which hosts, which stages) within the group's timeout.

Order: every rank walks the same list of pairs, in stage order (the schedule's first use), and
blocks on each pair it belongs to. The first unfinished pair of the list always has both of its
ranks waiting on it, so the walk cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_zeropp.core.settings.placement import rank_of_stage, schedule_style

__all__ = ["PipelineLinkError", "check_links", "link_pairs"]


class PipelineLinkError(RuntimeError):
    """A pipeline link failed its check at setup (a RuntimeError: the transport's symptom)."""


def link_pairs(schedule: str, pp_size: int, num_chunks: int) -> list[tuple[int, int, int]]:
    """(stage, sender, receiver) pipeline ranks of each stage boundary that crosses ranks, in stage
    order, each unordered pair once (its first boundary)."""
    style = schedule_style(schedule)
    seen: set[frozenset[int]] = set()
    out = []
    for stage in range(pp_size * num_chunks - 1):
        a, b = rank_of_stage(style, stage, pp_size), rank_of_stage(style, stage + 1, pp_size)
        if a != b and (pair := frozenset((a, b))) not in seen:
            seen.add(pair)
            out.append((stage, a, b))
    return out


def check_links(
    pp_group: dist.ProcessGroup,
    pairs: Sequence[tuple[int, int, int]],
    device: torch.device,
    hosts: Sequence[str] | None = None,
) -> None:
    """Exercise each (stage, sender, receiver) pair of pipeline ranks of `pp_group`: one element
    forward and one back (collective over the world: every rank walks the same pairs). Raises
    `PipelineLinkError` naming the ranks, hosts and stages of a link that fails."""
    me = dist.get_rank(pp_group)
    for stage, a, b in pairs:
        if me not in (a, b):
            continue
        peer = b if me == a else a
        ping = torch.full((1,), float(stage), device=device)
        try:
            for sender in (a, b):  # activations forward, then their gradients back
                if me == sender:
                    dist.send(ping, group=pp_group, group_dst=peer)
                else:
                    dist.recv(ping, group=pp_group, group_src=peer)
        except RuntimeError as err:
            raise PipelineLinkError(_message(pp_group, stage, a, b, hosts, err)) from err


def _message(
    group: dist.ProcessGroup,
    stage: int,
    a: int,
    b: int,
    hosts: Sequence[str] | None,
    err: BaseException,
) -> str:
    def name(pp_rank: int, held: int) -> str:
        rank = dist.get_global_rank(group, pp_rank)
        where = f"host {hosts[rank]}, " if hosts else ""
        return f"rank {rank} ({where}pp rank {pp_rank}, stage {held})"

    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    ga, gb = dist.get_global_rank(group, a), dist.get_global_rank(group, b)
    route = f" between {hosts[ga]} and {hosts[gb]}" if hosts else ""
    return (
        f"the pipeline link between {name(a, stage)} and {name(b, stage + 1)} failed its check "
        f"at setup (one element each way, before the first step): {first}. Check the network"
        f"{route} (the interface the backend binds: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, "
        "firewalls) and that both ranks were launched alike."
    )
