"""No wait without a deadline: a store that stops answering, a busy MASTER_PORT, a torchrun
restart sharing its store, a process group that never forms (`core.step.store`,
`core.settings.launch`, `core.step.failure`)."""

from __future__ import annotations

import gc
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_zeropp.core.settings import launch
from lightning_zeropp.core.step import failure
from lightning_zeropp.core.step.failure import FailureBoard, PeerFailedError
from lightning_zeropp.core.step.store import BoundedStore, StoreLost
from tests.distributed.launch import ROOT


class _Stopped(dist.Store):
    """A store whose host stopped (SIGSTOP, or a cut network): calls are taken, never answered."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = dist.HashStore()

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, value)  # a TCPStore client's set does not wait for an answer

    def check(self, keys: list[str]) -> bool:
        time.sleep(3600)
        return False

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        time.sleep(3600)
        return b""


def test_a_stopped_store_host_is_given_up_after_the_deadline() -> None:
    store = BoundedStore(_Stopped(), deadline_s=1.0)
    store.set("k", "v")
    start = time.monotonic()
    with pytest.raises(StoreLost, match=r"did not answer a check\(\) within 1 s") as info:
        store.check(["k"])
    assert time.monotonic() - start < 3.0 and not info.value.answered
    with pytest.raises(StoreLost):  # given up: later calls do not wait again
        store.set("k", "again")


def test_a_store_host_that_died_is_named_at_once() -> None:
    host = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=10), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", host.port, 2, False, timedelta(seconds=10))
    store = BoundedStore(client, deadline_s=5.0)
    assert not store.check(["k"])
    del host  # its process ended: the connection closes
    gc.collect()
    start = time.monotonic()
    with pytest.raises(StoreLost, match="closed the connection") as info:
        store.check(["k"])
    assert time.monotonic() - start < 3.0 and info.value.answered


def test_a_board_cut_off_from_its_store_names_the_host(group: None, monkeypatch) -> None:
    monkeypatch.setattr(failure, "_cut_gloo_connections", lambda keep_port: 0)
    board = FailureBoard("rank 2 (pipeline stage 1)", store=_Stopped(), store_deadline_s=1.0)
    board.world_size = 4  # built alone, now rank 2 of four, whose rank 0 hosts the store
    board.rank = 2
    board.namer = lambda r: f"rank {r} (pipeline stage {r // 2})"
    start = time.monotonic()
    with pytest.raises(PeerFailedError) as info, board.guard():
        raise RuntimeError("Timed out waiting 20000ms for recv operation to complete")
    assert time.monotonic() - start < 3.0
    assert str(info.value) == (
        "rank 0 (pipeline stage 0) was lost: the c10d store it hosts did not answer a "
        "compare_set() within 1 s; it was stopped, or the network to it is cut; rank 2 (pipeline stage 1) "
        "stopped because of it."
    )
    assert board.failed


def test_a_busy_master_port_is_refused_before_the_ranks_start(monkeypatch) -> None:
    import lightning.pytorch as pl

    from lightning_zeropp import ZeroPPStrategy

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ValueError, match=rf"MASTER_PORT={port} is in use on this machine"):
            launch.check_port_free("127.0.0.1", port)
        for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(ValueError, match=r"is in use on this machine .* Unset MASTER_PORT"):
            pl.Trainer(accelerator="cpu", devices=4, strategy=ZeroPPStrategy())
    launch.check_port_free("127.0.0.1", port)  # free again: no error


def test_a_torchrun_restart_sharing_its_store_is_refused() -> None:
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1"}
    with pytest.raises(ValueError, match=r"restart 1\b.*TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        launch.check_restart(shared | {"TORCHELASTIC_RESTART_COUNT": "1"})
    with pytest.warns(UserWarning, match="export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        launch.check_restart(shared | {"TORCHELASTIC_RESTART_COUNT": "0", "RANK": "0"})
    # With the variable set torchrun tells its workers the store is not shared.
    launch.check_restart(
        {"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RESTART_COUNT": "1"}
    )
    launch.check_restart({})  # not under torchrun


def test_a_layout_that_does_not_fit_a_restarted_elastic_world_says_why(monkeypatch) -> None:
    from lightning_zeropp.core import ZeroPPConfig

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(ValueError, match=r"restart 1 of an elastic job .* world of 2 processes: "
                       r"pp_size x dp_replicate_size x cp_size = 4 ranks do not fit it"):  # fmt: skip
        ZeroPPConfig(pp_size=4).resolve(2)
    with pytest.raises(ValueError, match="its fixed sizes do not match it. Leave dp_shard_size"):
        ZeroPPConfig(pp_size=2, dp_shard_size=2).resolve(2)
    assert ZeroPPConfig(pp_size=2).resolve(2).dp_shard_size == 1  # unset: it follows the world
    assert launch.restart_note(2, 4, {}) == ""  # a first attempt, or not under torchrun


def test_joining_a_group_that_never_forms_ends_the_process_with_a_reason() -> None:
    # The module alone (standard library only): importing the package would take seconds.
    code = (
        "import importlib.util, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('launch', {launch.__file__!r})\n"
        "launch = importlib.util.module_from_spec(spec); spec.loader.exec_module(launch)\n"
        "with launch.join_deadline(1.0, 'joining the process group (store at 10.0.0.9:1)'):\n"
        "    time.sleep(60)\n"
    )
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and time.monotonic() - start < 30
    assert "joining the process group (store at 10.0.0.9:1) did not complete within 1 s" in (
        done.stderr
    )
