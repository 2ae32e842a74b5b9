"""The check every front makes when a resume skips the data a checkpoint already trained.

A resume skips what was trained by counting: Lightning's batches into the epoch, the HF
Trainer's optimizer steps (`global_step`), an Accelerate loop's `skip_first_batches(loader, n)`.
A count names the trained rows only under the global batch the checkpoint was saved with; under
another one, skipping the same count skips other rows (some never trained, or trained rows
again), and no framework says so. Each front records its global batch in its checkpoints and
calls `check_resumed_rows` with the count it is about to skip: every rank reads the same
checkpoint and has the same loader settings, so every rank raises the same error, before any
collective of the resumed run.
"""

from __future__ import annotations

__all__ = ["LIGHTNING_FIX", "check_resumed_rows"]

LIGHTNING_FIX = (
    "Resume with the batch size the checkpoint was saved with, or from a checkpoint saved at "
    "the end of an epoch."
)


def check_resumed_rows(
    count: int,
    saved: int | None,
    now: int | None,
    where: str,
    unit: str = "batches",
    fix: str = LIGHTNING_FIX,
) -> None:
    """Raise if skipping `count` `unit` of `now` rows each skips other rows than the `count`
    of `saved` rows each the checkpoint trained. `where`: the sentence's subject (e.g. "this fit
    resumes 3 batches into epoch 0"). Nothing to check without a record (`saved` None: a
    checkpoint from before it) or a batch size (`now` None), or with nothing to skip."""
    if count <= 0 or saved is None or now is None or saved == now:
        return
    trained, skipped = count * saved, count * now
    what = (
        f"skip {skipped} rows, {skipped - trained} of them never trained"
        if skipped > trained
        else f"skip {skipped} rows and train {trained - skipped} trained rows again"
    )
    raise ValueError(
        f"{where}, saved with a global batch of {saved} rows ({trained} rows trained); this "
        f"run's global batch is {now} rows, so skipping {count} {unit} would {what}. {fix}"
    )
