"""FailureBoard's decisions on a one-rank gloo group with a fresh store per test (no peers to wake)."""

from __future__ import annotations

import pickle
import socket
import struct

import pytest
import torch.distributed as dist

from lightning_zeropp.core.step.failure import FailureBoard, PeerFailedError, _cut_gloo_connections

RECORD = "lightning_zeropp/failure/first"


def _board(store: dist.Store) -> FailureBoard:
    return FailureBoard("rank 0 (pipeline stage 0)", store=store, settle_s=0.05, grace_s=0.5)


class _CountingStore(dist.Store):
    """A HashStore that counts the calls made to it (the ones FailureBoard uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.calls = dist.HashStore(), 0

    def set(self, key: str, value: str | bytes) -> None:
        self.calls += 1
        self.inner.set(key, value)

    def check(self, keys: list[str]) -> bool:
        self.calls += 1
        return self.inner.check(keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self.calls += 1
        return self.inner.compare_set(key, expected, desired)


def test_happy_path_touches_no_store(group: None) -> None:
    store = _CountingStore()
    board = _board(store)
    for _ in range(3):
        with board.guard():
            pass
    assert store.calls == 0
    with pytest.raises(ValueError), board.guard():
        raise ValueError("now it does")
    assert store.calls > 0  # the count sees the board's calls


def test_own_error_is_recorded_and_reraised_unchanged(group: None) -> None:
    store = dist.HashStore()
    err = ValueError("bad loss shape")
    with pytest.raises(ValueError) as info, _board(store).guard():
        raise err
    assert info.value is err and err.__cause__ is None
    assert err.__notes__ == [
        "[lightning_zeropp] rank 0 (pipeline stage 0) failed first; every rank was told."
    ]
    assert b'"error": "ValueError: bad loss shape"' in store.get(RECORD)
    assert b"test_failure_board.py" in store.get(RECORD)  # where it was raised


def test_symptom_after_a_peer_failure_names_the_peer(group: None) -> None:
    store = dist.HashStore()
    peer = '{"rank": "3", "origin": "rank 3 (pipeline stage 1)", "error": "ValueError: bad loss shape", "where": ""}'
    store.set(RECORD, peer)
    transport = RuntimeError("Connection closed by peer")
    with pytest.raises(PeerFailedError) as info, _board(store).guard():
        raise transport
    assert str(info.value) == (
        "rank 3 (pipeline stage 1) failed with ValueError: bad loss shape; rank 0 (pipeline "
        "stage 0) stopped because of it. The traceback is in that rank's output."
    )
    assert info.value.__cause__ is transport
    assert (info.value.origin, info.value.error) == (
        "rank 3 (pipeline stage 1)",
        "ValueError: bad loss shape",
    )
    copy = pickle.loads(pickle.dumps(info.value))  # survives a trip between processes
    assert (str(copy), copy.origin) == (str(info.value), info.value.origin)


def test_peer_failed_error_and_nested_guards_pass_through(group: None) -> None:
    store = dist.HashStore()
    board = _board(store)
    passing = PeerFailedError("from elsewhere")
    with pytest.raises(PeerFailedError) as info, board.guard():
        raise passing
    assert info.value is passing and store.num_keys() == 0
    with pytest.raises(KeyError) as nested, board.guard(), board.guard():
        raise KeyError("k")
    assert len(nested.value.__notes__) == 1  # handled once, by the inner guard


def test_cut_ends_gloo_like_connections_only() -> None:
    # Gloo gives its pair sockets a receive timeout; a logger's or HTTP client's has none.
    with socket.create_server(("127.0.0.1", 0)) as server:
        plain = socket.create_connection(server.getsockname())
        plain_peer, _ = server.accept()
        gloo_like = socket.create_connection(server.getsockname())
        gloo_peer, _ = server.accept()
        gloo_like.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 30, 0))
        with plain, plain_peer, gloo_like, gloo_peer:
            assert _cut_gloo_connections(keep_port=None) >= 1
            assert gloo_peer.recv(1) == b""  # the peer sees the connection end
            plain.sendall(b"x")
            assert plain_peer.recv(1) == b"x"
