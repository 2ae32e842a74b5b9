"""Schedule: what each pipeline rank runs, in which order. `build` makes torch's schedules (and
ZeroPP's) over a rank's stages; `zeropp` plans ZeroPP's unit order and lowers it to gathers,
computes and releases; `runtime` executes a lowered plan on torch's pipeline runtime. Reads
settings only.

The names `lightning_zeropp.core.schedule` held when it was one file are re-exported here.
"""

from lightning_zeropp.core.schedule.build import (
    SCHEDULES,
    build_eval_schedule,
    build_schedule,
    eval_microbatches,
    zeropp_orders,
    zeropp_plans,
)

__all__ = [
    "SCHEDULES",
    "build_eval_schedule",
    "build_schedule",
    "eval_microbatches",
    "zeropp_orders",
    "zeropp_plans",
]
