"""The launcher's environment, checked before the process group forms.

Three ways a launch can go wrong that torch reports late, on one rank, or never:

- `MASTER_PORT` already in use on the machine that hosts the store (another run, a service):
  the host fails to listen, and the other ranks, connected to whatever holds the port, wait on it
  for ever. `check_port_free` says so before any rank is started (the Lightning front calls it
  where it starts the ranks itself).
- A torchrun restart whose workers share torchrun's rendezvous store (its default): the
  restarted attempt reads the previous attempt's addresses and fails in `init_process_group` with
  a gloo error, or hangs (pytorch/pytorch#135712). `check_restart` names the variable that
  avoids it: on a restart as an error, on a first attempt that may restart as a warning.
- A rank that joins no process group at all (the store's host died before listening, or never
  started): `join_deadline` bounds the wait, then says what was waited for and exits the
  process, since the blocked call cannot be interrupted.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import socket
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping

__all__ = ["check_port_free", "check_restart", "check_timeout", "join_deadline", "restart_note"]

_SHARE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def check_port_free(addr: str, port: int) -> None:
    """Raise `ValueError` if this machine cannot listen on `port` (at `addr`) because something
    holds it; other failures to listen are left to torch, which names them."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("" if family == socket.AF_INET else "::", port))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                return
            raise ValueError(
                f"MASTER_PORT={port} is in use on this machine (another run or a service holds "
                "it): rank 0 could not host the process group's store there, and the other ranks "
                "would wait on whatever holds it. Unset MASTER_PORT (a free port is chosen) or "
                "set it to a free port."
            ) from None


def check_timeout(timeout: object, name: str = "timeout") -> None:
    """The process groups' timeout: a positive `datetime.timedelta` (torch's own error for a
    number names neither the setting nor the fix)."""
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        seconds = timeout if isinstance(timeout, (int, float)) and timeout > 0 else 60
        raise ValueError(
            f"{name}={timeout!r} must be a positive datetime.timedelta, e.g. "
            f"{name}=datetime.timedelta(seconds={seconds:g}): it bounds every wait on another rank."
        )


def check_restart(environ: Mapping[str, str] | None = None) -> None:
    """Under torchrun: refuse a restarted attempt that shares torchrun's store (see the module);
    warn on a first attempt that may restart."""
    environ = os.environ if environ is None else environ
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return  # not torchrun, or its store is not shared (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
    restart = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    allowed = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    fix = (
        f"export {_SHARE_VAR}=1 before starting torchrun (each attempt then gets a store of its "
        "own)"
    )
    if restart > 0:
        raise ValueError(
            f"this is torchrun's restart {restart}, and its workers share torchrun's rendezvous "
            "store (TORCHELASTIC_USE_AGENT_STORE=True): the restarted attempt would read the "
            "previous attempt's addresses and fail or hang forming its process group. "
            f"{fix[0].upper()}{fix[1:]}."
        )
    if allowed > 0 and environ.get("RANK", "0") == "0":
        warnings.warn(
            f"torchrun may restart this job (--max-restarts {allowed}), and a restarted attempt "
            f"sharing torchrun's rendezvous store fails to form its process group: {fix}.",
            stacklevel=2,
        )


def restart_note(world_size: int, fixed: int, environ: Mapping[str, str] | None = None) -> str:
    """What a layout that does not fit the world says on top under an elastic restart: a job
    that lost nodes restarts on a smaller world (torchrun `--nnodes MIN:MAX`), where only the
    sizes the world does not decide (`fixed`: pp x dp_replicate x cp) must still fit. Empty on a
    first attempt or outside torchrun."""
    environ = os.environ if environ is None else environ
    restart = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart == 0:
        return ""
    does_not_fit = (
        f"pp_size x dp_replicate_size x cp_size = {fixed} ranks do not fit it, so this job "
        "cannot continue on fewer nodes"
        if fixed > world_size
        else "its fixed sizes do not match it"
    )
    return (
        f" This is torchrun's restart {restart} of an elastic job (TORCHELASTIC_RESTART_COUNT), "
        f"on a world of {world_size} processes: {does_not_fit}. Leave dp_shard_size unset (it "
        "follows the world) and keep pp_size x dp_replicate_size x cp_size within the smallest "
        "world the job may restart on (the --nnodes minimum x --nproc-per-node), or restart "
        "with more nodes."
    )


@contextlib.contextmanager
def join_deadline(seconds: float, what: str) -> Iterator[None]:
    """Run the block (joining a process group); if it has not returned after `seconds`, print
    why to stderr and end the process with exit status 1. A rank blocked on a store that never
    answers cannot be woken otherwise."""
    done = threading.Event()

    def expire() -> None:
        if done.wait(seconds):
            return
        print(
            f"[lightning_zeropp] rank {os.environ.get('RANK', '?')}: {what} did not complete "
            f"within {seconds:g} s; exiting.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    threading.Thread(target=expire, name="lzpp-join-deadline", daemon=True).start()
    try:
        yield
    finally:
        done.set()
