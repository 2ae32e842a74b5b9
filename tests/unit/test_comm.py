"""CommCounter on a one-rank gloo group: exact counts and bytes, and patching undone on exit."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lightning_zeropp.core.measure.axes import mesh_axis_namer
from lightning_zeropp.core.measure.comm import CommCounter

NAMES = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "isend", "batch_isend_irecv")


def _originals() -> dict[str, object]:
    return {f"{m.__name__}.{n}": getattr(m, n) for m in (dist, c10d) for n in NAMES}


@pytest.mark.filterwarnings("ignore:.*all_gather_into_tensor.*:FutureWarning")
def test_counts_and_bytes_are_exact(group: None) -> None:
    with CommCounter() as comm:
        dist.all_reduce(torch.ones(10))  # 40 bytes
        dist.all_reduce(torch.ones(3, dtype=torch.float64))  # 24 bytes
        shard = torch.ones(5, dtype=torch.bfloat16)  # 10 bytes
        dist.all_gather_into_tensor(torch.empty(5, dtype=torch.bfloat16), shard)
        dist.broadcast(torch.ones(2, dtype=torch.int64), src=0)  # 16 bytes
    assert comm.summary() == {
        "all_gather": {"world": {"count": 1, "bytes": 10}},
        "all_reduce": {"world": {"count": 2, "bytes": 64}},
        "broadcast": {"world": {"count": 1, "bytes": 16}},
    }


@pytest.mark.filterwarnings("ignore:.*all_gather_into_tensor.*:FutureWarning")
def test_nested_call_counted_once_and_axis_names(group: None) -> None:
    # all_gather_into_tensor calls all_gather_single internally: one call, not two.
    sub = dist.new_group([0], timeout=timedelta(seconds=60))
    with CommCounter(lambda g: "sub" if g is sub else "default") as comm:
        dist.all_gather_into_tensor(torch.empty(4), torch.ones(4), group=sub)
        dist.all_reduce(torch.ones(1))
    assert comm.summary() == {
        "all_gather": {"sub": {"count": 1, "bytes": 16}},
        "all_reduce": {"default": {"count": 1, "bytes": 4}},
    }
    dist.destroy_process_group(sub)


def test_patching_undone_on_exit_and_on_error(group: None) -> None:
    originals = _originals()
    with CommCounter() as comm:
        assert dist.all_reduce is not originals["torch.distributed.all_reduce"]
        assert (
            c10d.all_gather_into_tensor
            is not originals["torch.distributed.distributed_c10d.all_gather_into_tensor"]
        )
    assert _originals() == originals
    with pytest.raises(ValueError, match="boom"), CommCounter():
        raise ValueError("boom")
    assert _originals() == originals
    dist.all_reduce(torch.ones(1))  # nothing is recorded once the counter has exited
    assert comm.summary() == {}


def test_mesh_axis_namer(group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    name = mesh_axis_namer(mesh)
    # An axis spanning the world is the default group: both are named by the axis.
    assert name(mesh.get_group("dp_shard")) == "dp_shard"
    assert name(None) == "dp_shard"
    sub = dist.new_group([0], timeout=timedelta(seconds=60))
    assert name(sub) == "dp_shard"  # matched by ranks
    dist.destroy_process_group(sub)
