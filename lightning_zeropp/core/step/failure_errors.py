"""What the failure board (`core.step.failure`) raises and reads: `PeerFailedError`, the error a
rank raises when another failed first; `raised_everywhere`, the mark of an error every rank
raises alike (which the board lets pass); and how a failure is written down for the other ranks
(its text, cut to a bounded length, and the line that raised it).
"""

from __future__ import annotations

import traceback
from typing import TypeVar

__all__ = ["NOTE", "PeerFailedError", "error_text", "raised_at", "raised_everywhere"]

NOTE = "[lightning_zeropp] "  # starts the note on an exception the board already handled
_MAX_ERROR_CHARS = 4000
_E = TypeVar("_E", bound=BaseException)


class PeerFailedError(RuntimeError):
    """This rank stopped because another rank failed first; `origin` and `error` say which, how."""

    def __init__(self, message: str, *, origin: str = "", error: str = "") -> None:
        super().__init__(message)
        self.origin = origin  # e.g. "rank 3 (pipeline stage 1, dp_shard 1)"
        self.error = error  # e.g. "ValueError: bad loss shape"


def raised_everywhere(err: _E) -> _E:
    """Mark an error that every rank raises alike, agreed on in a collective that succeeded
    (`agree`, `raise_on_every_rank`): nobody waits on anybody and the groups stay usable, so
    the board lets it pass unrecorded."""
    err._lzpp_everywhere = True  # type: ignore[attr-defined]
    return err


def error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:_MAX_ERROR_CHARS]


def raised_at(err: BaseException) -> str:
    """'file.py:42 in fn', where the error was raised: the origin's traceback stays in its log."""
    frames = traceback.extract_tb(err.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
