"""Split: cut a model into pipeline stages. `blocks` finds the repeated layers and assigns them to
stages (`BlockPlan`); `methods` builds the stage modules by one of four ways (the model's own
forward cut at its block calls, `call_plan` + `call_stages` (+ `stubs`) + `tags`; torch's tracer with `chain`;
a pruned copy; or a user's callable); `tied` keeps a weight used on several stages one weight;
`modules` merges a rank's stages into one module; `copies` copies a model for its stages
(sharing the root's plain attributes). Reads settings only; knows nothing of sharding or schedules.

The names `lightning_zeropp.core.split` held when it was one file are re-exported here.
"""

from lightning_zeropp.core.split.blocks import BlockPlan, find_blocks, plan_blocks
from lightning_zeropp.core.split.methods import (
    SPLIT_ATTR,
    SplitFn,
    SplitMethod,
    check_no_tied_parameters,
    check_split,
    resolve_split,
    split_model,
)

__all__ = [
    "SPLIT_ATTR",
    "BlockPlan",
    "SplitFn",
    "SplitMethod",
    "check_no_tied_parameters",
    "check_split",
    "find_blocks",
    "plan_blocks",
    "resolve_split",
    "split_model",
]
