"""SIGTERM (a scheduler preempting the job) ends every rank at the same step boundary, named.

A signal handler runs between two bytecodes of the main thread, possibly inside a collective of
the pipeline: a collective there (Lightning's handler broadcasts) pairs with the wrong call on
the other ranks and deadlocks or corrupts the step. So the handler only records the signal
(`Preemption`); the ranks learn of it in the all-reduce every step already makes before it runs
(`core.step.batch.agree_on_step` carries one more flag: the lowest rank that received SIGTERM),
and every rank raises `PreemptedError` there, before any rank enters the schedule. The fronts
catch it at their step, save a checkpoint where their own resume finds it when the
`save_on_sigterm` setting asks for one, and raise it again with the step and the checkpoint
named. `PreemptedError` is a `SystemExit` of code 143 (128 + SIGTERM, what a shell reports for a
process SIGTERM ended), so an uncaught one exits non-zero, as schedulers expect; `announce`
prints its message on every rank, since Python prints no `SystemExit` with an integer code.

`Preemption.agree_now()` is the same agreement outside a step (the end of a run: a signal that
came during the last step or the last save), one all-reduce of one integer.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SIGTERM_EXIT_CODE", "PreemptedError", "Preemption", "announce"]

SIGTERM_EXIT_CODE = 128 + int(signal.SIGTERM)  # 143: what a shell reports for a SIGTERM'd process


class PreemptedError(SystemExit):
    """Every rank stopped because SIGTERM reached `rank` (the lowest rank it reached) before
    step `step`; `checkpoint` is where the front saved, if it did. Exits with code 143."""

    def __init__(self, message: str, *, rank: int = -1, step: int | None = None) -> None:
        super().__init__(message)
        self.code = SIGTERM_EXIT_CODE  # what the interpreter exits with (not the message)
        self.message, self.rank, self.step = message, rank, step
        self.checkpoint: str | None = None

    def __str__(self) -> str:
        return self.message


class Preemption:
    """This process's SIGTERM: `install()` the handler (main thread only, as Python requires),
    `received` once it ran. The process's instance is `Preemption.of_process()`."""

    _process: Preemption | None = None

    def __init__(self) -> None:
        self.received = False
        self._previous: Any = None
        self._installed = False

    @classmethod
    def of_process(cls) -> Preemption:
        if cls._process is None:
            cls._process = cls()
        return cls._process

    def install(self) -> None:
        """Handle SIGTERM from now on by recording it (no collective, no I/O). Idempotent; the
        handler it replaces is restored by `uninstall()`."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the step's own agreement tells every rank (see the module).
        self.received = True

    def flag(self, rank: int, world: int) -> int:
        """What this rank adds to a MIN all-reduce: its rank if it received SIGTERM, else
        `world` (the result is the lowest rank that did, or `world`)."""
        return rank if self.received else world

    def stopped(self, first: int, world: int, what: str = "this step") -> PreemptedError | None:
        """The error every rank raises when the agreed flag `first` names a rank."""
        if first >= world:
            return None
        self.received = True  # every rank now stops: a later agreement must say so too
        return PreemptedError(
            f"stopped by SIGTERM (received on rank {first}) before {what}; every rank stops here",
            rank=first,
        )

    def agree_now(self, device: torch.device, what: str = "the end of the run") -> None:
        """Collective over the world, outside a step: raise `PreemptedError` on every rank when
        any rank received SIGTERM."""
        if not (dist.is_available() and dist.is_initialized()):
            err = self.stopped(0 if self.received else 1, 1, what)
        else:
            world, rank = dist.get_world_size(), dist.get_rank()
            flag = torch.tensor([self.flag(rank, world)], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            err = self.stopped(int(flag), world, what)
        if err is not None:
            raise err


def announce(err: PreemptedError, description: str = "") -> PreemptedError:
    """Print `err`'s message on this rank (Python prints no SystemExit of an integer code) and
    return it, to raise."""
    who = f"{description}: " if description else ""
    print(f"[lightning_zeropp] {who}{err.message}", file=sys.stderr, flush=True)
    return err
