"""SIGTERM in the Lightning front: the library's handler instead of Lightning's, a checkpoint
where `ckpt_path="hpc"` finds it, and every rank exiting 143 naming SIGTERM.

Lightning's `_SignalConnector` handles SIGTERM with a `dist.broadcast` inside the signal
handler: it runs wherever the main thread is, often inside the pipeline's own collectives, and
the broadcast pairs with the wrong call on the other ranks (a deadlock until the timeout), or
the loops raise `SIGTERMException`, a `SystemExit` of status 0 that a scheduler reads as success.
`take_over_signals` replaces the trainer's connector with `ZeroPPSignals`, whose handler only
records the signal (`core.step.preempt`); the step's own agreement stops every rank at the next
step boundary, and `stopping` saves (`save_on_sigterm`) and names the step on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import TrainerFn

from lightning_zeropp.core.step.failure import failure_guard
from lightning_zeropp.core.step.preempt import PreemptedError, Preemption, announce

__all__ = ["ZeroPPSignals", "agree_at_end", "stopping", "take_over_signals"]


class ZeroPPSignals(_SignalConnector):
    """The trainer's signal connector under ZeroPP: SIGTERM is recorded, never acted on in the
    handler; `received_sigterm` stays False so that Lightning's loops never raise their
    status-0 `SIGTERMException` (the step's agreement raises `PreemptedError` instead)."""

    def register_signal_handlers(self) -> None:
        Preemption.of_process().install()

    def teardown(self) -> None:
        Preemption.of_process().uninstall()


def take_over_signals(trainer: pl.Trainer) -> None:
    """From now on (setup included) SIGTERM is the library's: Lightning's connector, which
    `Trainer._run` asks to register its handlers after setup, is replaced by `ZeroPPSignals`."""
    if not isinstance(trainer._signal_connector, ZeroPPSignals):
        trainer._signal_connector = ZeroPPSignals(trainer)
    Preemption.of_process().install()


@contextlib.contextmanager
def stopping(trainer: pl.Trainer, save: bool, description: str) -> Iterator[None]:
    """Around a strategy call that may meet the agreed stop: save a checkpoint when `save`
    (during fit, outside a gradient accumulation), then raise `PreemptedError` naming the step
    and the checkpoint, printed on every rank."""
    try:
        yield
    except PreemptedError as err:
        raise _stopped(trainer, err, save, description) from None


def agree_at_end(trainer: pl.Trainer, device: torch.device, save: bool, description: str) -> None:
    """At the end of a run: a SIGTERM that came during the last step or save stops every rank
    here (one all-reduce), not exit 0."""
    with stopping(trainer, save, description), failure_guard():
        Preemption.of_process().agree_now(device)


def _stopped(
    trainer: pl.Trainer, err: PreemptedError, save: bool, description: str
) -> PreemptedError:
    step = trainer.global_step
    where = f"received on rank {err.rank}" if err.rank >= 0 else "received"
    saved = "no checkpoint saved (set save_on_sigterm=True to save one)"
    if save:
        saved = _save(trainer)
    stopped = PreemptedError(f"stopped by SIGTERM ({where}) at step {step}; {saved}", rank=err.rank)
    stopped.step = step
    return announce(stopped, description)


def _save(trainer: pl.Trainer) -> str:
    """Save where `fit(ckpt_path="hpc")` resumes from (Lightning's own preemption checkpoint,
    `default_root_dir/hpc_ckpt_<n>.ckpt`); every rank calls it alike."""
    if trainer.state.fn != TrainerFn.FITTING:
        return "no checkpoint saved (not fitting)"
    done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
    if done % trainer.accumulate_grad_batches:
        # The accumulated gradients are in no checkpoint: a resume would lose them.
        return (
            f"no checkpoint saved: stopped inside a gradient accumulation (accumulate_grad_batches="
            f"{trainer.accumulate_grad_batches}); restart from the last checkpoint"
        )
    path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
    path = trainer.strategy.broadcast(path)  # rank 0's numbering: every rank writes one path
    trainer.save_checkpoint(path)
    return f"saved checkpoint at {path} (resume with fit(ckpt_path='hpc'))"
