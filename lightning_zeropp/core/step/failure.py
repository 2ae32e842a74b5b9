"""Root cause on every rank: when one rank fails, every rank raises an error that names it.

Otherwise a rank that raises (say the loss function on the last stage) leaves the others blocked
in collectives until the timeout or its exit, with transport errors that name nobody.

`FailureBoard.guard()` wraps a region that communicates (`failure_guard()` and `guarded`: the
process's board, `FailureBoard.of_process()`, which the engine and both fronts use from setup
on). On an exception inside it, a rank first writes its error where the others can read it and
waits (at most `settle_s`) to see whether every rank raised the very same one (a check all ranks
make alike, such as a bad setting): then nobody is blocked, and it is raised as it is. Otherwise
the rank
1. records "who failed, with what" in the c10d store, first writer wins. A RuntimeError (as
   transport errors and timeouts are) may be a symptom: it first waits up to `settle_s` for
   another's record, then calls the roll (`core.step.roll`); ranks that do not answer within
   `roll_call_s` are recorded as lost;
2. cuts its gloo connections (`core.step.sockets`), so ranks blocked on it fail now, not at the
   timeout (each woken rank does the same, which reaches ranks blocked only on woken ones);
3. marks the record seen and waits, at most `grace_s`, until every rank not lost has (the store
   lives in global rank 0's process, which must outlive the others' reads);
4. re-raises its own exception unchanged if it is the origin or failed with the origin's very
   error, else raises `PeerFailedError` naming the origin, its role and error, chained.
The happy path touches no store. Its errors and their text: `core.step.failure_errors`.

Every store call has a deadline (`core.step.store`: the world timeout, at most 10 s). A rank
whose store call fails, because the store's host (global rank 0) died or stopped or the network
to it is cut, needs no record to know what happened: it raises `PeerFailedError` naming the host
as lost, by the description the engine gave it (`describe`). After a failure the process groups
are unusable; `destroy_process_group()` and interpreter exit still return at once.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.distributed as dist

from lightning_zeropp.core._torch_private import default_store
from lightning_zeropp.core.mesh import describe_rank  # re-exported: its first home
from lightning_zeropp.core.step.failure_errors import (  # re-exported: their first home
    NOTE,
    PeerFailedError,
    error_text,
    raised_at,
    raised_everywhere,
)
from lightning_zeropp.core.step.roll import (
    KEY,
    NAME,
    RECORD,
    answer_roll_call,
    call_roll,
    host_lost_record,
    hosts_store,
    lost_record,
    start_answering,
    wait_until,
)
from lightning_zeropp.core.step.sockets import cut_gloo_connections as _cut_gloo_connections
from lightning_zeropp.core.step.sockets import tcp_port
from lightning_zeropp.core.step.store import BoundedStore, StoreLost, world_deadline_s

__all__ = [
    "FailureBoard",
    "PeerFailedError",
    "describe_rank",
    "failure_guard",
    "guarded",
    "raised_everywhere",
]

_PROCESS: list[Any] = []  # [world group, its board]: the process's board (`of_process`)


@contextlib.contextmanager
def failure_guard() -> Iterator[None]:
    """The process's board's guard (`FailureBoard.of_process`) when a default process group of
    several ranks exists; nothing otherwise."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield
        return
    with FailureBoard.of_process().guard(patient=True):
        yield


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
        deadline = store_deadline_s or world_deadline_s()
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
            self.store.set(f"{NAME}/{self.rank}", self.description)
            start_answering(self._raw, self.store, self.rank, self.world_size, _answer_roll_call)

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
            self.store.set(f"{NAME}/{self.rank}", description)

    @property
    def failed(self) -> bool:
        """Whether this rank has handled a failure: its process groups are unusable."""
        return self._record is not None

    @contextlib.contextmanager
    def guard(self, patient: bool = False) -> Iterator[None]:
        """Turn an exception inside into the job's root cause on every rank (see the module).

        `patient`: a region where an error other than a RuntimeError is most likely a check every
        rank makes alike (setup, a front's call): wait up to `grace_s`, not `settle_s`, for every
        rank to report the same error (ranks reach such checks seconds apart). Inside a step an
        error is most likely one rank's own (the loss function's) and is told at once."""
        try:
            yield
        except PeerFailedError:
            raise
        except Exception as err:
            if getattr(err, "_lzpp_everywhere", False):
                raise  # every rank raises it, with the groups intact: nothing to tell
            if any(n.startswith(NOTE) for n in getattr(err, "__notes__", ())):
                raise  # an inner guard already handled it
            instead = self._handle(err, patient)
            if instead is None:
                raise
            raise instead from err

    def _handle(self, err: Exception, patient: bool = False) -> BaseException | None:
        """Record or learn the first failure, wake the peers; the error to raise instead, if any."""
        mine = {"rank": str(self.rank), "origin": self.description, "error": error_text(err)}
        notes = []
        if self._record is None:
            try:
                wait_s = self.grace_s if patient and not isinstance(err, RuntimeError) else None
                if self._everyone_raised(mine["error"], wait_s or self.settle_s):  # no failure
                    return None
                self._record = self._publish(mine | {"where": raised_at(err)}, err)
            except StoreLost as lost:  # its host died or stopped, or the network to it is cut
                self._wake_peers()
                if not isinstance(err, RuntimeError):  # this rank's own error: still its own
                    err.add_note(f"{NOTE}{self._store_host()} {lost}: no other rank was told.")
                    return None
                self._record = host_lost_record(lost, lost.answered, self.namer)
            else:
                self._wake_peers()  # only now: a woken peer must find the record
                if missing := self._acknowledge():
                    notes.append(f"{NOTE}ranks {missing} did not report within {self.grace_s}s")
        first = self._record
        raised: BaseException = err
        if "lost" in first:
            message = f"{first['said']}; {self.description} stopped because of it."
            raised = PeerFailedError(message, origin=first["origin"], error=first["error"])
        elif first["rank"] == mine["rank"] or first["error"] == mine["error"]:
            notes.insert(0, f"{NOTE}{first['origin']} failed first; every rank was told.")
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

    def _everyone_raised(self, error: str, wait_s: float) -> bool:
        """Whether every rank raised this very error (a check all ranks make alike, before any
        collective): then the groups are intact and no rank needs waking. Waits at most
        `wait_s`, less once another rank raised something else or a record appears."""
        if self.world_size == 1:
            return False
        key = f"{KEY}/{self._generation}/raised"
        # The first report's text: a rank that raised something else says so to all at once.
        if self.store.compare_set(f"{key}/text", "", error).decode() != error:
            self.store.set(f"{key}/differs", "1")
            return False
        self.store.add(f"{key}/count", 1)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.store.check([RECORD]) or self.store.check([f"{key}/differs"]):
                return False
            if self.store.add(f"{key}/count", 0) == self.world_size:
                self._generation += 1  # every rank counts alike: they all saw every report
                return True
            time.sleep(0.02)
        return False

    def _publish(self, mine: dict, err: Exception) -> dict:
        # A RuntimeError may be a symptom: of a peer's failure, recorded first, or of a peer lost.
        if isinstance(err, RuntimeError) and self.world_size > 1:
            recorded = wait_until(lambda: self.store.check([RECORD]), self.settle_s, 0.01)
            lost = (
                []
                if recorded
                else call_roll(self.store, self.rank, self.world_size, self.roll_call_s)
            )
            if lost:
                mine = lost_record(self.store, lost, self.roll_call_s, self.namer)
        # compare_set with "" as the expected value writes only if the key does not exist yet and
        # returns what the key holds afterwards: the first failure, atomically.
        return json.loads(self.store.compare_set(RECORD, "", json.dumps(mine)))

    def _store_host(self) -> str:
        if hosts_store(0):
            return f"{self.namer(0)}, which hosts the c10d store,"
        return "the c10d store's host (the launcher's agent)"

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
        keys = [f"{KEY}/seen/{r}" for r in ranks]
        try:
            self.store.set(f"{KEY}/seen/{self.rank}", "1")
            if wait_until(lambda: self.store.check(keys), self.grace_s, interval_s=0.02):
                return []
            return [r for r, key in zip(ranks, keys, strict=True) if not self.store.check([key])]
        except Exception:  # the store host exited after everyone else had read: done anyway
            return []


def _answer_roll_call(store: dist.Store, rank: int, keep_port: int | None) -> None:
    """The answering thread (`roll.answer_roll_call`), cutting with this module's cut."""
    answer_roll_call(store, rank, keep_port, lambda port: _cut_gloo_connections(port))
