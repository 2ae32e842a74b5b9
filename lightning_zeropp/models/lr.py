"""Learning-rate shapes shared by the recipes of both fronts (torch only: the Accelerate recipe
must not need Lightning for its schedule)."""

from __future__ import annotations

import math

__all__ = ["warmup_cosine"]


def warmup_cosine(step: int, warmup_steps: int, max_steps: int) -> float:
    """LR factor at optimizer step `step`: linear warm-up, then cosine decay to 10%."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
