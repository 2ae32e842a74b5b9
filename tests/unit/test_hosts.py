"""The rank order the mesh is built over (`core.hosts.host_order`): every dp_shard group on one
host whatever order the launcher numbered ranks in, or a clear refusal naming hosts and counts."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_zeropp.core.hosts import PlacementError, check_node_size, host_order


def _groups(order: tuple[int, ...], shape: tuple[int, ...]) -> list[list[int]]:
    """The dp_shard groups (last axis) of a (pp, dp_replicate, dp_shard) mesh over `order`."""
    return torch.tensor(order).view(shape).reshape(-1, shape[-1]).tolist()


def _hosts_of(groups: list[list[int]], hosts: list[str]) -> list[set[str]]:
    return [{hosts[r] for r in g} for g in groups]


def test_block_numbering_is_left_as_it_is():
    hosts = ["a", "a", "b", "b"]
    assert host_order(hosts, 2).order == (0, 1, 2, 3)
    assert host_order(hosts, 2).is_identity


def test_one_host_is_left_as_it_is_for_every_group_size():
    for group in (1, 2, 3, 6):
        assert host_order(["vm"] * 6, group).is_identity


def test_cyclic_numbering_puts_each_shard_group_on_one_host():
    hosts = ["nodeA", "nodeB"] * 2  # SLURM --distribution=cyclic: rank r on node r % 2
    placed = host_order(hosts, 2)
    assert placed.order == (0, 2, 1, 3)
    groups = _groups(placed.order, (2, 1, 2))
    assert groups == [[0, 2], [1, 3]]
    assert _hosts_of(groups, hosts) == [{"nodeA"}, {"nodeB"}]
    assert placed.host_names == ["nodeA", "nodeB"] and placed.node_of(1) == 1


@pytest.mark.parametrize("seed", range(20))
def test_any_numbering_puts_each_group_on_one_host(seed: int):
    rng = random.Random(seed)
    per_host, nodes = rng.choice([2, 4, 8]), rng.choice([2, 3, 4])
    hosts = [f"n{i}" for i in range(nodes) for _ in range(per_host)]
    rng.shuffle(hosts)  # any launcher's numbering
    group = rng.choice([g for g in (1, 2, 4, 8) if per_host % g == 0])
    placed = host_order(hosts, group)
    assert sorted(placed.order) == list(range(len(hosts)))  # a permutation
    for g in range(0, len(hosts), group):
        assert len({hosts[r] for r in placed.order[g : g + group]}) == 1
    # Ranks of one host keep their order (a stable grouping, not a shuffle).
    for host in set(hosts):
        mine = [r for r in placed.order if hosts[r] == host]
        assert mine == sorted(mine)


def test_a_group_larger_than_a_host_spans_the_fewest_whole_hosts():
    hosts = ["a", "b", "c", "d"] * 2  # 4 hosts of 2 ranks, cyclic
    placed = host_order(hosts, 4)
    assert placed.group_hosts == 2
    assert _hosts_of(_groups(placed.order, (2, 1, 4)), hosts) == [{"a", "b"}, {"c", "d"}]


def test_unequal_hosts_that_still_fit_are_laid_out():
    hosts = ["a", "b", "a", "a", "b", "a"]  # a: 4 ranks, b: 2
    placed = host_order(hosts, 2)
    assert _hosts_of(_groups(placed.order, (3, 1, 2)), hosts) == [{"a"}, {"a"}, {"b"}]


@pytest.mark.parametrize(
    ("hosts", "group", "named"),
    [
        (["a", "a", "a", "b"], 2, "a: 3, b: 1"),
        (["a", "b", "b", "a", "c", "c"], 3, "a: 2, b: 2, c: 2"),
        (["x"] * 4 + ["y"] * 2, 6, "x: 4, y: 2"),
    ],
)
def test_a_world_that_cannot_be_laid_out_is_refused_naming_hosts_and_counts(
    hosts: list[str], group: int, named: str
):
    with pytest.raises(PlacementError, match="dp_shard groups of") as err:
        host_order(hosts, group)
    assert named in str(err.value)
    assert "dp_shard_size" in str(err.value)


def test_a_further_inner_dimension_composes():
    # A context-parallel axis inside dp_shard: the product of both must stay on one host.
    hosts = ["a", "b"] * 4
    shard, cp = 2, 2
    placed = host_order(hosts, shard * cp, what="dp_shard x cp")
    mesh = torch.tensor(placed.order).view(2, 1, shard, cp)
    for pp in range(2):
        assert len({hosts[r] for r in mesh[pp].flatten().tolist()}) == 1


def test_a_node_size_that_is_not_the_hosts_is_refused_where_zeropp_plus_uses_it():
    cyclic = host_order(["a", "b"] * 4, 2)  # 2 hosts of 4 ranks
    check_node_size(cyclic, 4)  # the hosts
    check_node_size(cyclic, 2)  # halves of a host: still inside one
    with pytest.raises(PlacementError, match="node_size=8 does not match") as err:
        check_node_size(cyclic, 8)
    assert "a: 4, b: 4" in str(err.value)
    check_node_size(host_order(["vm"] * 8, 2), 2)  # one machine: nodes emulated on it


def test_the_launchers_node_size_under_srun():
    from lightning_zeropp.fronts.settings import launcher_node_size

    assert launcher_node_size({"LOCAL_WORLD_SIZE": "4", "SLURM_NTASKS_PER_NODE": "2"}) == 4
    assert launcher_node_size({"SLURM_NTASKS_PER_NODE": "2"}) == 2  # srun sets no LOCAL_*
    assert launcher_node_size({"SLURM_NTASKS_PER_NODE": "2(x3)"}) is None  # not one number
    assert launcher_node_size({}) is None
