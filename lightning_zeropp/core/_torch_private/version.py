"""The torch releases the library supports, and the one switch on the installed release.

The private names in this package differ between torch releases; every difference is decided here
(`at_least`) and read by the module of `_torch_private/` that wraps that part of torch, nowhere
else. A release outside `SUPPORTED` is refused when `lightning_zeropp` is imported, before any of
its private names is reached (a missing one would fail far from its cause, or not at all).
"""

from __future__ import annotations

import re

import torch

__all__ = [
    "SUPPORTED",
    "SUPPORTED_RANGE",
    "at_least",
    "installed_release",
    "require_supported_torch",
]

# (first, last) minor release covered by the tests: CI runs the parity subset on both ends
# (tests/parity_subset.txt) and the whole suite on the default torch.
SUPPORTED: tuple[tuple[int, int], tuple[int, int]] = ((2, 11), (2, 14))
SUPPORTED_RANGE = f">={SUPPORTED[0][0]}.{SUPPORTED[0][1]},<{SUPPORTED[1][0]}.{SUPPORTED[1][1] + 1}"


def installed_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of the installed torch (or of `version`): "2.14.1+cu130" -> (2, 14)."""
    text = torch.__version__ if version is None else version
    found = re.match(r"(\d+)\.(\d+)", str(text))
    if found is None:
        raise ImportError(f"lightning_zeropp cannot read torch's version {text!r}")
    return int(found.group(1)), int(found.group(2))


def at_least(major: int, minor: int) -> bool:
    """Whether the installed torch is release `major.minor` or newer."""
    return installed_release() >= (major, minor)


def require_supported_torch() -> None:
    """Refuse a torch release outside `SUPPORTED`, naming the range and the fix."""
    release = installed_release()
    if SUPPORTED[0] <= release <= SUPPORTED[1]:
        return
    raise ImportError(
        f"lightning_zeropp supports torch {SUPPORTED_RANGE} (2.11 to 2.14), but torch "
        f"{torch.__version__} is installed: its pipelining and FSDP internals, which this library "
        f"uses, are untested there. Install a supported release, e.g. "
        f'`pip install "torch{SUPPORTED_RANGE}"`.'
    )
