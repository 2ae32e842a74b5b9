"""Store calls with a deadline: a rank cut off from the c10d store fails, it does not hang.

A TCPStore client waits on its socket without a deadline for most calls (`check`, `set`,
`compare_set`): when the store's host is stopped, or the network to it is cut, the call blocks
until TCP gives up, a quarter of an hour later. `BoundedStore` hands each call to a daemon thread
of its own and waits at most `deadline_s`; a call that does not return in time, or that fails because the
connection ended, marks the store lost and raises `StoreLost` naming why. Every later call then
raises at once: the blocked call still holds the client's connection, and its thread, a daemon,
does not keep the process from exiting.

Calls go through a thread only here, on paths that are already failing or that run once (setup);
a training step makes none.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_zeropp.core._torch_private import group_timeout

__all__ = ["BoundedStore", "StoreLost", "store_deadline_s", "world_deadline_s"]

_LONGEST_S = 10.0  # a store answers in milliseconds; a failing rank must not wait the world timeout


class StoreLost(RuntimeError):
    """The c10d store did not answer in time, or its connection ended (its host is gone)."""

    def __init__(self, message: str, *, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered  # False: no answer in time; True: the connection ended


def store_deadline_s(timeout: timedelta | None) -> float:
    """How long one store call may take: the world timeout, at most 10 s (at least 1 s)."""
    if timeout is None:
        return _LONGEST_S
    return max(1.0, min(timeout.total_seconds(), _LONGEST_S))


def world_deadline_s() -> float:
    """`store_deadline_s` of the default process group's timeout (10 s before one exists)."""
    world = group_timeout(dist.group.WORLD) if dist.is_initialized() else None
    return store_deadline_s(world)


class BoundedStore:
    """`store`'s calls, each with a deadline (see the module). `lost` says why it was given up."""

    def __init__(self, store: dist.Store, deadline_s: float) -> None:
        self.store = store
        self.deadline_s = deadline_s
        self.lost: StoreLost | None = None
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)
        return lambda *args: self.call(method, name, *args)

    def call(self, method: Any, name: str, *args: Any) -> Any:
        if self.lost is not None:
            raise self.lost
        if self._worker is None:  # one daemon thread makes the calls, started on first use
            self._worker = threading.Thread(target=self._work, name="lzpp-store", daemon=True)
            self._worker.start()
        done, box = threading.Event(), dict[str, Any]()
        self._calls.put((method, args, done, box))
        if not done.wait(self.deadline_s):
            self.lost = StoreLost(
                f"did not answer a {name}() within {self.deadline_s:g} s", answered=False
            )
            raise self.lost
        if "error" in box:
            err = box["error"]
            if isinstance(err, (RuntimeError, OSError)) and _connection_ended(err):
                self.lost = StoreLost(f"closed the connection ({err})", answered=True)
                raise self.lost from err
            raise err
        return box.get("value")

    def _work(self) -> None:
        while True:
            method, args, done, box = self._calls.get()
            try:
                box["value"] = method(*args)
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                box["error"] = err
            done.set()


def _connection_ended(err: BaseException) -> bool:
    """Whether a store error says the connection is gone (not a missing key or a bad value)."""
    text = str(err).lower()
    return any(
        word in text
        for word in ("connection", "broken pipe", "socket", "reset by peer", "closed", "timed out")
    ) or isinstance(err, (ConnectionError, dist.DistNetworkError))
