"""Asynchronous checkpoints: the step waits only for a copy of the state in host memory.

`AsyncCheckpointer.save` does what `checkpoint.save_checkpoint` does (the same files and
checksums, the temporary made by global rank 0 before its name is shared, the same atomic commit
under the name, `core.weights.commit`), but through `torch.distributed.checkpoint.async_save`:
the state is copied to new host tensors before `save` returns (so training may change the
parameters at once), and written by a background thread. Global rank 0 publishes the checkpoint
when its write finishes, which is after every rank's (DCP gathers their results before writing
the metadata). Until then the name still holds the previous checkpoint.

One save runs at a time: a save started while another writes first waits for it (every rank
waits alike, so the saves stay in one order). A checkpoint the pending save replaces is deleted
only once that save is complete (`remove`). DCP's thread synchronizes the ranks on a gloo group
of its own, created (collectively, with the world timeout) at the first save: collectives from
two threads must not share the training's groups. A failure in the background (a rank lost while
it writes, a full disk) goes to the failure board at once (`core.step.failure`): every rank's
next collective raises naming it, not only the next save's wait.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from lightning_zeropp.core.mesh import world_timeout
from lightning_zeropp.core.step.failure import (
    FailureBoard,
    PeerFailedError,
    failure_guard,
    guarded,
)
from lightning_zeropp.core.weights import checksum, commit
from lightning_zeropp.core.weights.checkpoint import checkpoint_state, finish_save, prepare_save

__all__ = ["AsyncCheckpointer"]


class AsyncCheckpointer:
    """Background checkpoint saves, one at a time. Every method is collective: all ranks call
    them in the same order (as they call `save_checkpoint`)."""

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._pending: Future[Path] | None = None
        self._removals: list[Path] = []  # to delete once the pending save is published
        self._lock = threading.Lock()

    @guarded
    def save(
        self,
        path: str | Path,
        model: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        meta: dict[str, Any] | None = None,
    ) -> Future[Path]:
        """Start saving; returns once the state is copied. The future gives `path` once the
        checkpoint is complete (and, on global rank 0, published); `wait()` waits for it."""
        self.wait()
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=world_timeout())
        path = Path(path)
        tmp = prepare_save(path, meta or {})
        state = checkpoint_state(model, optimizers)
        written = dcp.async_save(
            state, storage_writer=checksum.ChecksumWriter(str(tmp)), process_group=self._group
        )
        assert isinstance(written, Future)  # an AsyncSaveResponse comes only with a stager
        done: Future[Path] = Future()

        def publish(future: Future[Any]) -> None:
            try:
                with failure_guard():  # the background thread's failure is every rank's
                    _result(future, path)
                    if dist.get_rank() == 0:
                        finish_save(tmp, path)
                        self._remove_queued()
            except BaseException as err:  # handed to whoever waits
                done.set_exception(err)
            else:
                done.set_result(path)

        written.add_done_callback(publish)
        self._pending = done
        return done

    def remove(self, path: str | Path) -> None:
        """Delete the checkpoint at `path` (on global rank 0) once the pending save is complete:
        `ModelCheckpoint` drops the checkpoint a new one replaces right after starting the new
        one, and until it is written the old one is the last complete one. Not collective."""
        if dist.get_rank() != 0:
            return
        with self._lock:  # the save's thread removes what is queued once it has published
            if self._pending is not None and not self._pending.done():
                self._removals.append(Path(path))
                return
        commit.remove(path)

    def _remove_queued(self) -> None:
        with self._lock:
            queued, self._removals = self._removals, []
        for path in queued:
            commit.remove(path)

    @guarded
    def wait(self) -> Path | None:
        """Block until the last save is complete and published on every rank; re-raise its
        error. Returns its path (None when no save was pending). After a failure elsewhere (the
        process groups are unusable) it returns at once: the last save is not complete."""
        pending, self._pending = self._pending, None
        if pending is None or _failed():
            return None
        try:
            path = pending.result()
        except Exception as err:
            if isinstance(err, PeerFailedError) or _handled(err):
                raise  # named by the board already
            raise RuntimeError(f"the asynchronous checkpoint save failed: {err}") from err
        # Rank 0 publishes after its own write: nobody reads the name before that.
        dist.barrier()
        return path


def _result(future: Future[Any], path: Path) -> None:
    """The write's outcome; DCP's `CheckpointException` (a BaseException, which no guard would
    see) as a RuntimeError naming the first rank that failed and its error."""
    try:
        future.result()
    except CheckpointException as err:
        rank, (cause, _) = next(iter(err.failures.items()))
        raise RuntimeError(
            f"writing the checkpoint {path} failed on rank {rank}: {type(cause).__name__}: {cause}"
        ) from None


def _handled(err: BaseException) -> bool:
    return any(note.startswith("[lightning_zeropp]") for note in getattr(err, "__notes__", ()))


def _failed() -> bool:
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return distributed and FailureBoard.of_process().failed
