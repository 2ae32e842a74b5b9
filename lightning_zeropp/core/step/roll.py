"""The roll call: which ranks are alive, asked over the c10d store (`core.step.failure`).

Every rank's failure board writes its description under `NAME/{rank}` when built and keeps a
daemon thread waiting, on a store connection of its own, for `WAKE/{rank}`. A rank that meets a
transport error or a timeout calls the roll (`call_roll`): it wakes every rank's thread, each
answers under `HERE/{rank}` (busy main thread or not) and then cuts its rank's gloo connections,
since the job is failing. A rank that does not answer within the roll call's time was killed,
crashed or stopped, and is named by the description it wrote (`lost_record`). A rank that
cannot reach the store at all names its host instead (`host_lost_record`), by its own deduction.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = [
    "HERE",
    "KEY",
    "NAME",
    "RECORD",
    "WAKE",
    "answer_roll_call",
    "call_roll",
    "host_lost_record",
    "hosts_store",
    "lost_record",
    "start_answering",
    "wait_until",
]

KEY = "lightning_zeropp/failure"
RECORD = f"{KEY}/first"
WAKE = f"{KEY}/wake"  # /{rank}: "roll" (a roll call) or "exit" (this process is exiting)
HERE = f"{KEY}/here"  # /{rank}: that rank answered the roll call
NAME = f"{KEY}/rank"  # /{rank}: that rank's description, written when its board is built


def call_roll(store: Any, rank: int, world_size: int, roll_call_s: float) -> list[int]:
    """The ranks that did not answer within `roll_call_s` (none once a record appears)."""
    wake = [f"{WAKE}/{r}" for r in range(world_size)]
    store.multi_set(wake, ["roll"] * world_size)  # wakes every rank's answerer
    store.set(f"{HERE}/{rank}", "1")
    keys = [f"{HERE}/{r}" for r in range(world_size)]
    done = lambda: store.check(keys) or store.check([RECORD])  # noqa: E731
    wait_until(done, roll_call_s, interval_s=0.05)
    if store.check([RECORD]):
        return []
    return [r for r, key in enumerate(keys) if not store.check([key])]


def answer_roll_call(
    store: dist.Store, rank: int, keep_port: int | None, cut: Callable[[int | None], Any]
) -> None:
    """A board's daemon thread: answers the roll call, if one comes, then cuts this rank's gloo
    connections (`cut`). A process that can answer is alive; a killed or stopped one cannot."""
    try:
        store.wait([f"{WAKE}/{rank}"], timedelta(days=365))
        if store.get(f"{WAKE}/{rank}") == b"exit":
            return
        store.set(f"{HERE}/{rank}", "1")
    except Exception:  # the store closed: the job ended (or its host was lost), no roll call
        return
    cut(keep_port)


def start_answering(
    raw: dist.Store, bounded: Any, rank: int, world_size: int, answer: Callable[..., Any]
) -> None:
    """Start this rank's answering thread, `answer(store, rank, keep_port)`, on a connection of
    its own (`raw.clone()`: its blocked wait must not hold up the board's calls), stopped at
    exit through `bounded` (the board's store with deadlines)."""
    try:
        store = raw.clone()  # type: ignore[attr-defined]  # torch's stubs omit Store.clone
    except Exception:  # a store that cannot clone: only ranks inside a guard answer
        return
    args = (store, rank, _port(raw))
    (thread := threading.Thread(target=answer, args=args, daemon=True)).start()
    atexit.register(_stop_answering, thread, bounded, rank, world_size)


def _stop_answering(thread: threading.Thread, store: Any, rank: int, world_size: int) -> None:
    """At exit, before finalizing: a thread waking in C++ then aborts the process. The store's
    host stops every rank's (its exit would wake them, each logging a C++ warning)."""
    if thread.is_alive() and store.lost is None:  # a lost store: no wake-up comes
        ranks = range(world_size) if hosts_store(rank) else [rank]
        with contextlib.suppress(Exception):  # the store is gone: the thread ended with it
            store.multi_set([f"{WAKE}/{r}" for r in ranks], ["exit"] * len(ranks))
        thread.join(timeout=5.0)


def _port(store: dist.Store) -> int | None:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.port if isinstance(store, dist.TCPStore) else None


def lost_record(
    store: Any, lost: list[int], roll_call_s: float, namer: Callable[[int], str]
) -> dict:
    """The record naming the lost ranks, by the descriptions they wrote when they could."""
    known = lambda r: store.check([f"{NAME}/{r}"])  # noqa: E731 - else get() blocks
    origin = " and ".join(store.get(f"{NAME}/{r}").decode() if known(r) else namer(r) for r in lost)
    why = f"within {roll_call_s:g} s (killed, crashed or stopped)"
    said = "was lost: it" if len(lost) == 1 else "were lost: they"
    return _record(lost, origin, f"lost: did not answer {why}", f"{said} did not answer {why}")


def host_lost_record(why_lost: Exception, answered: bool, namer: Callable[[int], str]) -> dict:
    """The record of a lost store, from this rank's own deduction (no store to read)."""
    why = "its process ended" if answered else "it was stopped, or the network to it is cut"
    origin = namer(0) if hosts_store(0) else "the c10d store's host"
    said = f"was lost: the c10d store it hosts {why_lost}; {why}"
    return _record([0] if hosts_store(0) else [], origin, f"lost: the store {why_lost}", said)


def hosts_store(rank: int) -> bool:
    """Whether `rank` hosts the default store: rank 0 does, unless torchrun's agent hosts it."""
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def wait_until(done: Callable[[], bool], timeout_s: float, interval_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True


def _record(lost: list[int], origin: str, error: str, said: str) -> dict:
    rank = ",".join(map(str, lost))
    return {"rank": rank, "origin": origin, "error": error, "where": "", "lost": lost,
            "said": f"{origin} {said}"}  # fmt: skip
