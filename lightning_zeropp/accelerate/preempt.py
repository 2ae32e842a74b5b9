"""SIGTERM in the Accelerate front (and `ZeroPPTrainer`, built on it): every rank stops at the
next `model(**batch)` in training or evaluation, saves its state when `save_on_sigterm` asks,
and exits 143 naming SIGTERM (`core.step.preempt`: the handler records the signal, the step's
agreement all-reduce tells every rank).

`ZeroPPAccelerator` installs the handler when it is built (before `prepare`), so a signal at
set-up stops the first step. The state goes where the loop's own resume finds it:
`accelerator.save_state()` under `ProjectConfiguration(automatic_checkpoint_naming=True)`
(`load_state()` reads the newest), else `save_state(<project_dir or cwd>/sigterm_step_<n>)`;
`ZeroPPTrainer` saves its `checkpoint-<step>` (`resume_from_checkpoint=True`). A stop inside a
gradient accumulation saves nothing: its accumulated gradients are in no checkpoint.

A signal after the last step is agreed on at the end of the run: `ZeroPPTrainer.train` returns
through one more agreement, a bare loop's `accelerator.end_training()` makes it (a loop that
never calls it leaves such a signal unreported). The handler is the library's until then: the
end of `train()` or `end_training()` restores the one before it (not `free_memory()`: the
Trainer calls it when its training loop begins). The step
number counts the training batches the pipelined model ran, kept in `save_state`'s checkpoint,
so it goes on after a resume instead of restarting at 0.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_zeropp.core.step.preempt import PreemptedError, Preemption, announce

__all__ = ["Stopper", "accelerate_saver", "agree_at_end"]

# what a front saves with: `save(steps)` -> a sentence naming the checkpoint and how to resume
Saver = Callable[[int], str]


class Stopper:
    """What `PipelineModel` does on the agreed stop: count its training calls, save with
    `saver` when `save` (at an update boundary), and raise `PreemptedError` named on this rank.

    `accumulation()`: training calls per optimizer update; `step()`: the updates done (default:
    this process's calls over `accumulation()`; the Trainer gives its `global_step`)."""

    def __init__(
        self,
        saver: Saver,
        save: bool,
        accumulation: Callable[[], int],
        step: Callable[[], int] | None = None,
    ) -> None:
        self.saver, self.save, self.accumulation = saver, save, accumulation
        self.step = step or (lambda: self.batches // max(self.accumulation(), 1))
        self.batches: int = 0  # training calls completed by this process (the same on every rank)

    def stopped(self, err: PreemptedError, description: str) -> PreemptedError:
        steps, every = self.step(), max(self.accumulation(), 1)
        saved = "no state saved (save_on_sigterm=True saves one)"
        if self.save and self.batches % every:
            saved = (
                f"no state saved: stopped inside a gradient accumulation ({self.batches % every} "
                f"of {every} batches); restart from the last saved state"
            )
        elif self.save:
            saved = self.saver(steps)
        where = f"received on rank {err.rank}" if err.rank >= 0 else "received"
        again = PreemptedError(
            f"stopped by SIGTERM ({where}) at step {steps}; {saved}", rank=err.rank
        )
        again.step = steps
        return announce(again, description)


def accelerate_saver(accelerator: Any) -> Saver:
    """Save with `accelerator.save_state` where the loop's resume finds it (see the module)."""

    def save(steps: int) -> str:
        if accelerator.project_configuration.automatic_checkpoint_naming:
            path = accelerator.save_state()
            how = "accelerator.load_state() reads the newest"
        else:
            root = Path(accelerator.project_dir or os.getcwd())
            path = accelerator.save_state(str(root / f"sigterm_step_{steps}"))
            how = f"accelerator.load_state({str(path)!r}), then skip the {steps} steps' batches"
        return f"saved state at {path} ({how})"

    return save


def agree_at_end(pipeline: Any) -> None:
    """Collective, at the end of `ZeroPPTrainer.train`: a SIGTERM during the last step or save
    stops every rank here (one all-reduce), not exit 0; a bare Accelerate loop agrees in
    `accelerator.end_training()`, its documented last call."""
    stopper = getattr(pipeline, "stopper", None)
    if stopper is None:
        return
    core = pipeline.engine.core
    try:
        with core.failures.guard():
            Preemption.of_process().agree_now(core.device)
    except PreemptedError as err:
        raise stopper.stopped(err, core.failures.description) from None
