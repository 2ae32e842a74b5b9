"""The planner's profile of a model on the meta device: `core.split.profile`, which the engine also
runs to cut stages by cost (one count for both), re-exported under its planner name."""

from lightning_zeropp.core.split.profile import (
    ModelProfile,
    Part,
    lm_loss,
    meta_forward,
    micro_batch_rows,
    profile_model,
)

__all__ = ["ModelProfile", "Part", "lm_loss", "meta_forward", "micro_batch_rows", "profile_model"]
