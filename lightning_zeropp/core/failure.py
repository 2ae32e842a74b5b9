"""Root cause on every rank: when one rank fails, every rank raises an error that names it.

Otherwise a rank that raises (say the loss function on the last pipeline stage) leaves the others
blocked in collectives until they die, at the timeout or when it exits, with transport errors
("Connection closed by peer") that name neither the failing rank nor its error.

`FailureBoard.guard()` wraps a region that communicates. On an exception inside it, a rank
1. records "who failed, with what" in the c10d store, first writer wins (a RuntimeError, which
   transport errors are, may be a symptom: it first waits up to `settle_s` for another's record);
2. cuts its gloo connections, so ranks blocked on it fail now, not at the timeout (each woken
   rank does the same, which reaches ranks blocked only on woken ones);
3. marks the record seen and waits, at most `grace_s`, until every rank has (the store lives in
   global rank 0's process, which must outlive the others' reads);
4. re-raises its own exception unchanged if it is the origin or failed with the origin's very
   error, else raises `PeerFailedError` naming the origin, its role and error, chained.

The happy path touches no store. After a failure the process groups are unusable (the job is
failing); `destroy_process_group()` and interpreter exit still return at once. Why sockets:
torch 2.13's gloo `ProcessGroup.abort()` is a no-op, and a gloo connection ends only when its
process destroys the backend or exits. `groups` are still aborted, for backends where that acts.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import time
import traceback
from collections.abc import Callable, Iterator, Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_zeropp.core._torch_private import default_store

__all__ = ["FailureBoard", "PeerFailedError", "describe_rank"]

_KEY = "lightning_zeropp/failure"
_NOTE = "[lightning_zeropp] "  # starts the note on an exception this module already handled
_MAX_ERROR_CHARS = 4000


class PeerFailedError(RuntimeError):
    """This rank stopped because another rank failed first; `origin` and `error` say which, how."""

    def __init__(self, message: str, *, origin: str = "", error: str = "") -> None:
        super().__init__(message)
        self.origin = origin  # e.g. "rank 3 (pipeline stage 1, dp_shard 1)"
        self.error = error  # e.g. "ValueError: bad loss shape"


class FailureBoard:
    """Makes a failure on one rank raise, on every rank, an error naming that rank.

    Build one on every rank after the process groups exist and wrap each region that
    communicates in `guard()`. The record sits under a fixed key of `store`: one failure per
    store, which is no loss, since the process groups are unusable after it.

    Args:
        description: this rank's name in messages, e.g. `describe_rank(mesh, stage_ids)`
            (default: "rank N").
        store: a store every rank shares (default: the default process group's).
        groups: process groups to `abort()` on failure, for backends where that wakes peers.
        grace_s: longest wait for the other ranks to read the record before raising.
        settle_s: longest wait for another rank's record when this rank's error may be a symptom.
    """

    def __init__(
        self,
        description: str | None = None,
        *,
        store: dist.Store | None = None,
        groups: Sequence[dist.ProcessGroup] = (),
        grace_s: float = 10.0,
        settle_s: float = 1.0,
    ) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.description = description or f"rank {self.rank}"
        self.store = store if store is not None else default_store()
        self.groups = [g for g in groups if isinstance(g, dist.ProcessGroup)]
        self.grace_s = grace_s
        self.settle_s = settle_s
        self._store_port = _tcp_port(self.store)
        self._record: dict[str, str] | None = None  # the first failure, once this rank knows it

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn an exception inside into the job's root cause on every rank (see the module)."""
        try:
            yield
        except PeerFailedError:
            raise
        except Exception as err:
            if any(n.startswith(_NOTE) for n in getattr(err, "__notes__", ())):
                raise  # an inner guard already handled it
            instead = self._handle(err)
            if instead is None:
                raise
            raise instead from err

    def _handle(self, err: Exception) -> BaseException | None:
        """Record or learn the first failure, wake the peers; the error to raise instead, if any."""
        mine = {"rank": str(self.rank), "origin": self.description, "error": _error_text(err)}
        notes = []
        if self._record is None:
            try:
                self._record = self._publish(mine | {"where": _where(err)}, err)
            except Exception as store_err:  # the store is gone (rank 0 died): nothing to learn
                self._wake_peers()
                err.add_note(f"{_NOTE}the c10d store is unreachable ({store_err})")
                return None
            self._wake_peers()  # only now: a woken peer must find the record
            if missing := self._acknowledge():
                notes.append(f"{_NOTE}ranks {missing} did not report within {self.grace_s}s")
        first = self._record
        raised: BaseException = err
        if first["rank"] == mine["rank"] or first["error"] == mine["error"]:
            notes.insert(0, f"{_NOTE}{first['origin']} failed first; every rank was told.")
        else:
            where = f" (at {first['where']})" if first["where"] else ""
            raised = PeerFailedError(
                f"{first['origin']} failed with {first['error']}{where}; {self.description} "
                "stopped because of it. The traceback is in that rank's output.",
                origin=first["origin"],
                error=first["error"],
            )
        for note in notes:
            raised.add_note(note)
        return None if raised is err else raised

    def _publish(self, mine: dict[str, str], err: Exception) -> dict[str, str]:
        record_key = f"{_KEY}/first"
        if isinstance(err, RuntimeError):  # maybe a symptom of a peer's failure, recorded first
            _wait_until(lambda: self.store.check([record_key]), self.settle_s, interval_s=0.01)
        # compare_set with "" as the expected value writes only if the key does not exist yet and
        # returns what the key holds afterwards: the first failure, atomically.
        return json.loads(self.store.compare_set(record_key, "", json.dumps(mine)))

    def _wake_peers(self) -> None:
        for group in self.groups:
            group.abort()
        if self.world_size > 1:
            _cut_gloo_connections(keep_port=self._store_port)

    def _acknowledge(self) -> list[int]:
        """Mark the record seen; wait until every rank has. Returns the ranks that did not."""
        keys = [f"{_KEY}/seen/{r}" for r in range(self.world_size)]
        try:
            self.store.set(keys[self.rank], "1")
            if _wait_until(lambda: self.store.check(keys), self.grace_s, interval_s=0.02):
                return []
            return [r for r, key in enumerate(keys) if not self.store.check([key])]
        except Exception:  # the store host exited after everyone else had read: done anyway
            return []


def describe_rank(mesh: DeviceMesh | None = None, stage_ids: Sequence[int] = ()) -> str:
    """This rank's name for messages: 'rank 3 (pipeline stage 1, dp_shard 1)'.

    Names the stages given, then this rank's coordinate on every mesh axis longer than one
    (the "pp" coordinate only when no stages are given).
    """
    parts = []
    if stage_ids:
        plural = "s" if len(stage_ids) > 1 else ""
        parts.append(f"pipeline stage{plural} " + " and ".join(str(s) for s in stage_ids))
    if mesh is not None:
        for dim, name in enumerate(mesh.mesh_dim_names or ()):
            if mesh.size(dim) > 1 and not (name == "pp" and stage_ids):
                parts.append(f"{name} {mesh.get_local_rank(name)}")
    return f"rank {dist.get_rank()}" + (f" ({', '.join(parts)})" if parts else "")


def _error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:_MAX_ERROR_CHARS]


def _where(err: BaseException) -> str:
    """'file.py:42 in fn', where the error was raised: the origin's traceback stays in its log."""
    frames = traceback.extract_tb(err.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""


def _wait_until(done: Callable[[], bool], timeout_s: float, interval_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True


def _tcp_port(store: dist.Store) -> int | None:
    """The TCPStore port behind `store`: its connections must survive the cut."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.port if isinstance(store, dist.TCPStore) else None


def _cut_gloo_connections(keep_port: int | None) -> int:
    """Shut down this process's gloo TCP connections (the peers see them close); return how many.

    Gloo's TCP transport gives each pair socket a receive timeout (SO_RCVTIMEO, the group
    timeout), which Python's sockets and the store's do not have: that tells gloo's apart, so a
    logger's or an HTTP client's connections survive. shutdown(), not close(): gloo keeps its
    descriptor, sees the connection end and fails its own pending operations.
    """
    fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    cut = 0
    for name in os.listdir(fd_dir):
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            dup = os.dup(fd)  # shares the connection; ours to close
        except (OSError, ValueError):
            continue  # closed meanwhile, or not a descriptor
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ports = (sock.getsockname()[1], sock.getpeername()[1])
                timeout = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)
                if sock.type == socket.SOCK_STREAM and keep_port not in ports and any(timeout):
                    sock.shutdown(socket.SHUT_RDWR)
                    cut += 1
            except OSError:
                continue  # a listener (no peer), or already closed
    return cut
