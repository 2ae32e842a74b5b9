"""The loop state of a fit that a stop ended, written as the position it stopped at, so that
`fit(ckpt_path=...)` continues as the fit would have (the rows, the epochs' hooks, and the step
the loggers get, Lightning's `_batches_that_stepped`).

A fit that stops inside an epoch (`max_steps`, or `trainer.should_stop` from a callback) ends
that epoch in Lightning's bookkeeping: the loops count it completed, so a checkpoint written after
(`trainer.save_checkpoint` once fit returns, or `ModelCheckpoint` in the epoch's end hook) resumed
in the next epoch, and the stopped epoch's unseen batches were never trained (the next epoch's
were skipped, or the rest drawn from the next epoch's permutation). `settle_stopped_epoch`
(`ZeroPPStrategy`'s save) writes such a checkpoint as:

- an epoch cut short: the epoch reopened, its last trained batch as Lightning's own save in that
  batch's `on_train_batch_end` writes it (`ModelCheckpoint(every_n_train_steps=...)`): the
  batch's completion and, if it stepped, its logger step one short; Lightning's restart adds
  both back, and the loader skips the trained batches (`data.ResumingLoader`);
- an epoch ended (its last batch, or `on_train_batch_start` returning -1): the next epoch's start,
  every batch count of the ended one complete and this epoch's zero.

Why that form: Lightning 2.6 restarts a checkpoint whose batch counts are all equal as a save
made in that batch's validation, before the batch's step was counted; where the restored position
is a validation check (`val_check_interval`, an epoch's end when the module validates, and an
epoch's batch -1 whenever validation is by batches) it skips that validation and counts the step
then. A settled save is written after the step was counted, so with equal counts the loggers'
step came out one too high after a stop at a validation check (rows and `global_step` right). A
batch saved in its `on_train_batch_end` is restarted alike at any position: the completion, and
the step if the batch stepped, are added back at once.

Lightning restarts at a next epoch's start only in a fit under `max_steps` (it restarts its loops
wherever they stopped then; otherwise a new epoch begins afresh, which equal counts are right
for), so that form cannot be written at the save: `restart_at_epoch_start`, on
`ZeroPPStrategy`'s load (which knows the resumed fit's `max_steps`), writes it then, for the new
epoch's batch -1.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

__all__ = ["restart_at_epoch_start", "settle_stopped_epoch"]

_BATCHES = "epoch_loop.batch_progress"
_EPOCH_LOOP = "epoch_loop.state_dict"  # where Lightning keeps `_batches_that_stepped`
_STEPPED = "_batches_that_stepped"


def settle_stopped_epoch(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """`checkpoint` with the loops' state of an epoch that ended (a stop, or its last batch),
    saved after fit returned or in the epoch's end hook (`ModelCheckpoint`'s per-epoch save),
    written as the data position it is (see the module docstring).

    - Cut short (its batch count below the epoch's, not at its last batch): the epoch reopened,
      processed and completed one less, as a save inside that epoch writes them, and its last
      trained batch as saved in its `on_train_batch_end`, so the resume continues it instead of
      starting the next epoch, at the loggers' next step. Lightning's own state (after fit:
      counted completed; in the end hook: processed) resumed in the next epoch, with the stopped
      epoch's batch count (the unseen batches never trained) or its sampler epoch one on (the
      rest of the epoch drawn from the next permutation).
    - Ended: counted completed, every batch fetched complete (one the user's -1 skipped too)
      and this epoch's batch counts zero, as the next epoch starts it. Otherwise a resume under
      `max_steps` (Lightning restores the count then) took the whole next epoch as trained, or,
      from the end hook, skipped a permutation.
    """
    loops = checkpoint.get("loops", {}).get("fit_loop")
    batches, total = trainer.fit_loop.epoch_loop.batch_progress, trainer.num_training_batches
    if loops is None or batches.current.ready <= 0 or total == float("inf"):
        return checkpoint
    epochs = loops["epoch_progress"]["current"]  # the fit loop's, as saved
    after_fit = epochs["completed"] == epochs["processed"] == epochs["started"] == epochs["ready"]
    in_end_hook = (
        epochs["processed"] == epochs["started"] == epochs["ready"]
        and epochs["completed"] == epochs["processed"] - 1
    )
    if epochs["started"] <= 0 or not (after_fit or in_end_hook):
        # Saved inside the epoch: Lightning resumes it where it stopped.
        return checkpoint
    counts = loops[_BATCHES]
    # Batches fetched in all: one the user's -1 skipped was fetched and processed, never started
    # or completed; counted complete, the counts are those of a batch's end, as restarts read them.
    fetched = counts["total"]["ready"]
    stepped = loops[_EPOCH_LOOP][_STEPPED]
    if batches.current.ready < total and not batches.is_last_batch:
        # The epoch that ran is the last one started; the sampler's epoch is read from
        # `processed` on resume, so it reshuffles as this epoch did.
        progress = {
            part: {**counts, "processed": counts["started"] - 1, "completed": counts["started"] - 1}
            for part, counts in loops["epoch_progress"].items()
        }
        trained = counts["current"]["ready"]
        batch_progress = {
            "total": _counts(fetched, completed=fetched - 1),
            "current": _counts(trained, completed=trained - 1),
            "is_last_batch": False,
        }
        # The restart counts the step again when the batch stepped: the same test on the same
        # counts as at the batch's end in this fit.
        stepped -= not trainer.fit_loop.epoch_loop._should_accumulate()
        epoch = epochs["started"] - 1
    else:
        progress = {
            part: {**counts, "completed": counts["processed"]}
            for part, counts in loops["epoch_progress"].items()
        }
        batch_progress = {"total": _counts(fetched), "current": _counts(0), "is_last_batch": False}
        epoch = checkpoint.get("epoch", epochs["completed"])  # Lightning's, as it wrote it
    fit_loop = {
        **loops,
        "epoch_progress": progress,
        _BATCHES: batch_progress,
        _EPOCH_LOOP: {**loops[_EPOCH_LOOP], _STEPPED: stepped},
    }
    return {**checkpoint, "loops": {**checkpoint["loops"], "fit_loop": fit_loop}, "epoch": epoch}


def restart_at_epoch_start(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """`checkpoint`, loaded to resume `trainer`'s fit, with a next epoch's start as
    `settle_stopped_epoch` writes one (the fit's epochs all ended, this epoch's batch counts
    zero, the others complete) written for Lightning's restart when the fit restarts its loops
    (under `max_steps`): the epoch's batch -1 as saved in its `on_train_batch_end`, its completion
    and logger step one short, which the restart adds back (it always counts the step of a batch
    -1). With equal counts the restart took the start for a save in validation and counted a
    step again when batch -1 is a validation check (see the module docstring).
    """
    loops = checkpoint.get("loops", {}).get("fit_loop")
    if trainer.max_steps == -1 or loops is None:
        return checkpoint  # without max_steps a new epoch starts afresh: nothing is restarted
    counts = loops.get(_BATCHES)
    epochs_ended = all(_equal(loops["epoch_progress"][part]) for part in ("total", "current"))
    if counts is None or not epochs_ended or counts["is_last_batch"]:
        return checkpoint
    ended, this_epoch = counts["total"], counts["current"]
    if not _equal(ended) or ended["completed"] <= 0 or any(this_epoch.values()):
        return checkpoint
    batch_progress = {
        "total": {**ended, "completed": ended["completed"] - 1},
        "current": {**this_epoch, "completed": -1},
        "is_last_batch": False,
    }
    epoch_loop = {**loops[_EPOCH_LOOP], _STEPPED: loops[_EPOCH_LOOP][_STEPPED] - 1}
    fit_loop = {**loops, _BATCHES: batch_progress, _EPOCH_LOOP: epoch_loop}
    return {**checkpoint, "loops": {**checkpoint["loops"], "fit_loop": fit_loop}}


def _counts(count: int, completed: int | None = None) -> dict[str, int]:
    """One of Lightning's batch progress trackers: `count` batches fetched, started and
    processed, and `completed` (default `count`) completed."""
    done = count if completed is None else completed
    return {"ready": count, "started": count, "processed": count, "completed": done}


def _equal(counts: dict[str, int]) -> bool:
    return len(set(counts.values())) == 1
