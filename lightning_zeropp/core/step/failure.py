"""Root cause on every rank: when one rank fails, every rank raises an error that names it.

Otherwise a rank that raises (say the loss function on the last stage) leaves the others blocked
in collectives until the timeout or its exit, with transport errors that name nobody.

`FailureBoard.guard()` wraps a region that communicates (`failure_guard()`: the process's board,
`FailureBoard.of_process()`, which the engine and both fronts use from setup on). On an exception
inside it, a rank
1. records "who failed, with what" in the c10d store, first writer wins. A RuntimeError (as
   transport errors and timeouts are) may be a symptom: it first waits up to `settle_s` for
   another's record, then calls the roll (below); ranks that do not answer are recorded as lost;
2. cuts its gloo connections, so ranks blocked on it fail now, not at the timeout (each woken
   rank does the same, which reaches ranks blocked only on woken ones);
3. marks the record seen and waits, at most `grace_s`, until every rank not lost has (the store
   lives in global rank 0's process, which must outlive the others' reads);
4. re-raises its own exception unchanged if it is the origin or failed with the origin's very
   error, else raises `PeerFailedError` naming the origin, its role and error, chained.
Before all this it writes its error where the others can read it and waits (at most `settle_s`)
to see whether every rank raised the very same one (a check every rank makes alike, such as a bad
setting): then nobody is blocked and nothing needs recording or waking, and the process groups
stay usable.

The roll: a board (of several ranks) writes its rank's description to the store when built and
starts a thread that waits, on a store connection of its own, for a roll call. It answers, busy
main thread or not, then cuts this rank's gloo connections (the job is failing: that wakes a main
thread blocked on the lost rank before its timeout). No answer within `roll_call_s`: the rank was
killed, crashed or stopped. The happy path touches no store.

Losing the store itself: every store call has a deadline (`core.step.store`, the world timeout,
at most 10 s). A rank whose store call fails, because the store's host (global rank 0) died or
stopped or the network to it is cut, needs no record to know what happened: it raises
`PeerFailedError` naming the host as lost, by the description the engine gave (`describe`).

After a failure the process groups are unusable; `destroy_process_group()` and interpreter exit
still return at once. `groups` are aborted too, for backends where that acts (gloo's is a no-op,
hence the sockets: `core.step.sockets`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from lightning_zeropp.core._torch_private import default_store, group_timeout
from lightning_zeropp.core.mesh import describe_rank  # re-exported: its first home
from lightning_zeropp.core.step.sockets import cut_gloo_connections as _cut_gloo_connections
from lightning_zeropp.core.step.sockets import tcp_port
from lightning_zeropp.core.step.store import BoundedStore, StoreLost, store_deadline_s

__all__ = [
    "FailureBoard",
    "PeerFailedError",
    "describe_rank",
    "failure_guard",
    "guarded",
    "raised_everywhere",
]

_KEY = "lightning_zeropp/failure"
_RECORD = f"{_KEY}/first"
_WAKE = f"{_KEY}/wake"  # /{rank}: "roll" (a roll call) or "exit" (this process is exiting)
_HERE = f"{_KEY}/here"  # /{rank}: that rank answered the roll call
_NAME = f"{_KEY}/rank"  # /{rank}: that rank's description, written when its board is built
_NOTE = "[lightning_zeropp] "  # starts the note on an exception this module already handled
_MAX_ERROR_CHARS = 4000
_E = TypeVar("_E", bound=BaseException)
_PROCESS: list[Any] = []  # [world group, its board]: the process's board (`of_process`)


class PeerFailedError(RuntimeError):
    """This rank stopped because another rank failed first; `origin` and `error` say which, how."""

    def __init__(self, message: str, *, origin: str = "", error: str = "") -> None:
        super().__init__(message)
        self.origin = origin  # e.g. "rank 3 (pipeline stage 1, dp_shard 1)"
        self.error = error  # e.g. "ValueError: bad loss shape"


@contextlib.contextmanager
def failure_guard() -> Iterator[None]:
    """The process's board's guard (`FailureBoard.of_process`) when a default process group of
    several ranks exists; nothing otherwise."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield
        return
    with FailureBoard.of_process().guard():
        yield


def raised_everywhere(err: _E) -> _E:
    """Mark an error that every rank raises alike, agreed on in a collective that succeeded
    (`agree`, `raise_on_every_rank`): nobody waits on anybody and the groups stay usable, so
    the board lets it pass unrecorded."""
    err._lzpp_everywhere = True  # type: ignore[attr-defined]
    return err


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run under `failure_guard()`: a call that communicates, its failures named everywhere."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with failure_guard():
            return fn(*args, **kwargs)

    return run


class FailureBoard:
    """Makes a failure on one rank raise, on every rank, an error naming that rank.

    Build one on every rank after the process groups exist (or take the process's,
    `of_process()`) and wrap each region that communicates in `guard()`. The record sits under a
    fixed key of `store`: one failure per store, which is no loss, since the process groups are
    unusable after it.

    Args:
        description: this rank's name in messages, e.g. `describe_rank(mesh, stage_ids)`
            (default: "rank N"; `describe` changes it).
        store: a store every rank shares (default: the default process group's).
        groups: process groups to `abort()` on failure, for backends where that wakes peers.
        grace_s: longest wait for the other ranks to read the record before raising.
        settle_s: longest wait for another rank's record when this rank's error may be a symptom.
        roll_call_s: how long a rank has to answer a roll call before it counts as lost.
        store_deadline_s: longest wait for one store call (default: the world timeout, at most
            10 s); a store that misses it is lost.
    """

    def __init__(
        self,
        description: str | None = None,
        *,
        store: dist.Store | None = None,
        groups: Sequence[dist.ProcessGroup] = (),
        grace_s: float = 10.0,
        settle_s: float = 1.0,
        roll_call_s: float = 5.0,
        store_deadline_s: float | None = None,
    ) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.description = description or f"rank {self.rank}"
        self.namer: Callable[[int], str] = lambda r: f"rank {r}"
        raw = store if store is not None else default_store()
        deadline = store_deadline_s or _deadline_s()
        self.store: Any = BoundedStore(raw, deadline)
        self.groups = [g for g in groups if isinstance(g, dist.ProcessGroup)]
        self.grace_s = grace_s
        self.settle_s = settle_s
        self.roll_call_s = roll_call_s
        self._raw = raw
        self._store_port = tcp_port(raw)
        self._record: dict | None = None  # the first failure, once this rank knows it
        self._generation = 0  # errors every rank raised alike so far (`_everyone_raised`)
        if self.world_size > 1:  # alone, no rank can be lost
            # Now, while it can: a rank that is lost writes nothing.
            self.store.set(f"{_NAME}/{self.rank}", self.description)
            self._start_answering()

    @classmethod
    def of_process(cls) -> FailureBoard:
        """The board of this process's default process group: made on first use (every rank
        makes it: a board writes its description to the store), made anew for a new group."""
        if not _PROCESS or _PROCESS[0] is not dist.group.WORLD:
            _PROCESS[:] = [dist.group.WORLD, cls()]
        return _PROCESS[1]

    def describe(self, description: str, namer: Callable[[int], str] | None = None) -> None:
        """This rank's name in messages from now on, and `namer(rank)`, any rank's: the engine's
        (pipeline stage, data-parallel coordinates) once its mesh exists."""
        self.description = description
        if namer is not None:
            self.namer = namer
        if self.world_size > 1 and self._record is None:
            self.store.set(f"{_NAME}/{self.rank}", description)

    @property
    def failed(self) -> bool:
        """Whether this rank has handled a failure: its process groups are unusable."""
        return self._record is not None

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn an exception inside into the job's root cause on every rank (see the module)."""
        try:
            yield
        except PeerFailedError:
            raise
        except Exception as err:
            if getattr(err, "_lzpp_everywhere", False):
                raise  # every rank raises it, with the groups intact: nothing to tell
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
                if self._everyone_raised(mine["error"]):  # nobody waits on anybody: no failure
                    return None
                self._record = self._publish(mine | {"where": _where(err)}, err)
            except StoreLost as lost:  # its host died or stopped, or the network to it is cut
                self._wake_peers()
                if not isinstance(err, RuntimeError):  # this rank's own error: still its own
                    err.add_note(f"{_NOTE}{self._store_host()} {lost}: no other rank was told.")
                    return None
                self._record = self._host_lost(lost)
            else:
                self._wake_peers()  # only now: a woken peer must find the record
                if missing := self._acknowledge():
                    notes.append(f"{_NOTE}ranks {missing} did not report within {self.grace_s}s")
        first = self._record
        raised: BaseException = err
        if "lost" in first:
            message = f"{first['said']}; {self.description} stopped because of it."
            raised = PeerFailedError(message, origin=first["origin"], error=first["error"])
        elif first["rank"] == mine["rank"] or first["error"] == mine["error"]:
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

    def _everyone_raised(self, error: str) -> bool:
        """Whether every rank raised this very error (a check all ranks make alike, before any
        collective): then the groups are intact and no rank needs waking. Waits at most
        `settle_s`, less once another rank raised something else or a record appears."""
        if self.world_size == 1:
            return False
        key = f"{_KEY}/{self._generation}/raised"
        self.store.set(f"{key}/{self.rank}", error)
        keys = [f"{key}/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + self.settle_s
        while time.monotonic() < deadline and not self.store.check([_RECORD]):
            present = [k for k in keys if self.store.check([k])]
            if any(v.decode() != error for v in self.store.multi_get(present)):
                return False
            if len(present) == self.world_size:
                self._generation += 1  # every rank counts alike: they all saw every report
                return True
            time.sleep(0.01)
        return False

    def _publish(self, mine: dict, err: Exception) -> dict:
        # A RuntimeError may be a symptom: of a peer's failure, recorded first, or of a peer lost.
        if isinstance(err, RuntimeError) and self.world_size > 1:
            recorded = _wait_until(lambda: self.store.check([_RECORD]), self.settle_s, 0.01)
            if not recorded and (lost := self._roll_call()):
                mine = self._lost(lost)
        # compare_set with "" as the expected value writes only if the key does not exist yet and
        # returns what the key holds afterwards: the first failure, atomically.
        return json.loads(self.store.compare_set(_RECORD, "", json.dumps(mine)))

    def _roll_call(self) -> list[int]:
        """The ranks that did not answer within `roll_call_s` (none once a record appears)."""
        wake = [f"{_WAKE}/{r}" for r in range(self.world_size)]
        self.store.multi_set(wake, ["roll"] * self.world_size)  # wakes every rank's answerer
        self.store.set(f"{_HERE}/{self.rank}", "1")
        keys = [f"{_HERE}/{r}" for r in range(self.world_size)]
        done = lambda: self.store.check(keys) or self.store.check([_RECORD])  # noqa: E731
        _wait_until(done, self.roll_call_s, interval_s=0.05)
        if self.store.check([_RECORD]):
            return []
        return [r for r, key in enumerate(keys) if not self.store.check([key])]

    def _lost(self, lost: list[int]) -> dict:
        """The record naming the lost ranks, by the descriptions they wrote when they could."""
        known = lambda r: self.store.check([f"{_NAME}/{r}"])  # noqa: E731 - else get() blocks
        origin = " and ".join(
            self.store.get(f"{_NAME}/{r}").decode() if known(r) else self.namer(r) for r in lost
        )
        why = f"within {self.roll_call_s:g} s (killed, crashed or stopped)"
        said = "was lost: it" if len(lost) == 1 else "were lost: they"
        return _lost_record(
            lost, origin, f"lost: did not answer {why}", f"{said} did not answer {why}"
        )

    def _store_host(self) -> str:
        if _hosts_store(0):
            return f"{self.namer(0)}, which hosts the c10d store,"
        return "the c10d store's host (the launcher's agent)"

    def _host_lost(self, lost: StoreLost) -> dict:
        """The record of a lost store, from this rank's own deduction (no store to read)."""
        why = (
            "its process ended" if lost.answered else "it was stopped, or the network to it is cut"
        )
        origin = self.namer(0) if _hosts_store(0) else "the c10d store's host"
        said = f"was lost: the c10d store it hosts {lost} ({why})"
        return _lost_record([0] if _hosts_store(0) else [], origin, f"lost: the store {lost}", said)

    def _start_answering(self) -> None:
        try:  # a connection of its own: its blocked wait must not hold up this board's calls
            store = self._raw.clone()
        except Exception:  # a store that cannot clone: only ranks inside a guard answer
            return
        args = (store, self.rank, self._store_port)
        (thread := threading.Thread(target=_answer_roll_call, args=args, daemon=True)).start()
        atexit.register(self._stop_answering, thread)

    def _stop_answering(self, thread: threading.Thread) -> None:
        """At exit, before finalizing: a thread waking in C++ then aborts the process. The store's
        host stops every rank's (its exit would wake them, each logging a C++ warning)."""
        if thread.is_alive() and self.store.lost is None:  # a lost store: no wake-up comes
            ranks = range(self.world_size) if _hosts_store(self.rank) else [self.rank]
            with contextlib.suppress(Exception):  # the store is gone: the thread ended with it
                self.store.multi_set([f"{_WAKE}/{r}" for r in ranks], ["exit"] * len(ranks))
            thread.join(timeout=5.0)

    def _wake_peers(self) -> None:
        for group in self.groups:
            group.abort()
        if self.world_size > 1:
            _cut_gloo_connections(keep_port=self._store_port)

    def _acknowledge(self) -> list[int]:
        """Mark the record seen; wait until every rank has. Returns the ranks that did not."""
        assert self._record is not None
        lost = set(self._record.get("lost", ()))
        ranks = [r for r in range(self.world_size) if r not in lost]
        keys = [f"{_KEY}/seen/{r}" for r in ranks]
        try:
            self.store.set(f"{_KEY}/seen/{self.rank}", "1")
            if _wait_until(lambda: self.store.check(keys), self.grace_s, interval_s=0.02):
                return []
            return [r for r, key in zip(ranks, keys, strict=True) if not self.store.check([key])]
        except Exception:  # the store host exited after everyone else had read: done anyway
            return []


def _lost_record(lost: list[int], origin: str, error: str, said: str) -> dict:
    rank = ",".join(map(str, lost))
    return {"rank": rank, "origin": origin, "error": error, "where": "", "lost": lost,
            "said": f"{origin} {said}"}  # fmt: skip


def _answer_roll_call(store: dist.Store, rank: int, keep_port: int | None) -> None:
    """A board's daemon thread: answers the roll call, if one comes, then cuts this rank's gloo
    connections. A process that can answer is alive; a killed or stopped one cannot."""
    try:
        store.wait([f"{_WAKE}/{rank}"], timedelta(days=365))
        if store.get(f"{_WAKE}/{rank}") == b"exit":
            return
        store.set(f"{_HERE}/{rank}", "1")
    except Exception:  # the store closed: the job ended (or its host was lost), no roll call
        return
    _cut_gloo_connections(keep_port)


def _deadline_s() -> float:
    world = group_timeout(dist.group.WORLD) if dist.is_initialized() else None
    return store_deadline_s(world)


def _hosts_store(rank: int) -> bool:
    """Whether `rank` hosts the default store: rank 0 does, unless torchrun's agent hosts it."""
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


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
