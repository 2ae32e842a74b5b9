"""Asynchronous checkpoints: the step waits only for a copy of the state in host memory.

`AsyncCheckpointer.save` does what `checkpoint.save_checkpoint` does (the same files, the same
atomic commit under the name, `core.weights.commit`), but through `torch.distributed.checkpoint.async_save`:
the state is copied to new host tensors before `save` returns (so training may change the
parameters at once), and written by a background thread. Global rank 0 publishes the checkpoint
when its write finishes, which is after every rank's (DCP gathers their results before writing
the metadata). Until then the name still holds the previous checkpoint.

One save runs at a time: a new one first waits for the last. DCP's thread synchronizes the ranks
on a gloo group of its own, created (collectively, with the world timeout) at the first save:
collectives from two threads must not share the training's groups.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_zeropp.core.mesh import world_timeout
from lightning_zeropp.core.weights import commit
from lightning_zeropp.core.weights.checkpoint import META_FILE, broadcast_str, checkpoint_state

__all__ = ["AsyncCheckpointer"]


class AsyncCheckpointer:
    """Background checkpoint saves, one at a time. Every method is collective: all ranks call
    them in the same order (as they call `save_checkpoint`)."""

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._pending: Future[Path] | None = None

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
        tmp = Path(broadcast_str(str(commit.temporary(path))))
        if dist.get_rank() == 0:
            tmp.mkdir(parents=True)
            torch.save(meta or {}, tmp / META_FILE)
        state = checkpoint_state(model, optimizers)
        written = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group)
        done: Future[Path] = Future()

        def publish(future: Future[Any]) -> None:
            try:
                future.result()
                if dist.get_rank() == 0:
                    commit.publish(tmp, path)
            except BaseException as err:  # handed to whoever waits
                done.set_exception(err)
            else:
                done.set_result(path)

        written.add_done_callback(publish)
        self._pending = done
        return done

    def wait(self) -> Path | None:
        """Block until the last save is complete and published on every rank; re-raise its
        error. Returns its path (None when no save was pending)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        error: BaseException | None = None
        try:
            path = pending.result()
        except BaseException as err:  # raised after the barrier
            error, path = err, None
        # Rank 0 publishes after its own write: nobody reads the name before that.
        dist.barrier()
        if error is not None:
            raise RuntimeError(f"the asynchronous checkpoint save failed: {error}") from error
        return path
