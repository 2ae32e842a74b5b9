"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.distributed.launch import free_port


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    """A one-rank gloo process group for the tests of one module, for code that needs one."""
    dist.init_process_group(
        "gloo",
        rank=0,
        world_size=1,
        init_method=f"tcp://127.0.0.1:{free_port()}",
        timeout=timedelta(seconds=60),
    )
    yield
    dist.destroy_process_group()
