"""FailureBoard's roll call on one process: the answering thread, and the record of lost ranks.

A one-rank gloo group; a board is made to act as rank 0 of a bigger world by setting its
`world_size`, with the other ranks' answers written into the store by hand.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_zeropp.core.step import failure
from lightning_zeropp.core.step.failure import FailureBoard, PeerFailedError

KEY = "lightning_zeropp/failure"


@pytest.fixture
def no_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """The board would cut this test process's gloo-like connections: nothing to wake here."""
    monkeypatch.setattr(failure, "_cut_gloo_connections", lambda keep_port: 0)


def _board(store: dist.Store, world_size: int) -> FailureBoard:
    board = FailureBoard("rank 0 (pipeline stage 0)", store=store, settle_s=0.05, grace_s=0.2)
    board.roll_call_s = 0.3
    board.world_size = world_size  # built alone (no answering thread), now rank 0 of more
    return board


def test_a_silent_rank_is_named_lost(group: None, no_cut: None) -> None:
    store = dist.HashStore()
    store.set(f"{KEY}/rank/2", "rank 2 (pipeline stage 1)")  # written when its board was built
    for key in (f"{KEY}/here/1", f"{KEY}/seen/1"):  # rank 1 answers and reads the record
        store.set(key, "1")
    transport = RuntimeError("Connection reset by peer")
    with pytest.raises(PeerFailedError) as info, _board(store, 3).guard():
        raise transport
    assert str(info.value) == (
        "rank 2 (pipeline stage 1) was lost: it did not answer within 0.3 s (killed, crashed or "
        "stopped); rank 0 (pipeline stage 0) stopped because of it."
    )
    assert info.value.origin == "rank 2 (pipeline stage 1)"
    assert info.value.__cause__ is transport
    assert not getattr(info.value, "__notes__", None)  # rank 2 is not awaited as a reader
    assert store.get(f"{KEY}/wake/2") == b"roll"  # every rank's answering thread was woken


def test_two_silent_ranks_and_one_without_a_description(group: None, no_cut: None) -> None:
    store = dist.HashStore()
    store.set(f"{KEY}/rank/1", "rank 1 (pipeline stage 0)")
    with pytest.raises(PeerFailedError) as info, _board(store, 3).guard():
        raise RuntimeError("Timed out waiting 10000ms for recv operation to complete")
    assert str(info.value).startswith(
        "rank 1 (pipeline stage 0) and rank 2 were lost: they did not answer within 0.3 s"
    )


def test_when_every_rank_answers_the_error_is_this_ranks_own(group: None, no_cut: None) -> None:
    # A RuntimeError of this rank's own (not a symptom): the roll call ends at the last answer.
    store = dist.HashStore()
    for key in (f"{KEY}/here/1", f"{KEY}/seen/1"):
        store.set(key, "1")
    err = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info, _board(store, 2).guard():
        raise err
    assert info.value is err and "failed first" in err.__notes__[0]
    assert time.monotonic() - start < 0.25  # settle_s, not roll_call_s


def test_the_answering_thread_answers_a_roll_call_and_leaves_at_exit(no_cut: None) -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    threads = []
    for rank in (0, 1):  # the thread waits on a connection of its own
        args = (server.clone(), rank, server.port)
        threads.append(threading.Thread(target=failure._answer_roll_call, args=args))
        threads[-1].start()
    server.set(f"{KEY}/wake/0", "roll")
    server.set(f"{KEY}/wake/1", "exit")
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()
    assert server.check([f"{KEY}/here/0"])  # it answered
    assert not server.check([f"{KEY}/here/1"])  # told to leave, it did not answer
