"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
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


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread for the test: with tiny matmuls, threads only contend (100x
    slower on a busy 2-core machine). Use with `pytestmark = pytest.mark.usefixtures(...)`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
