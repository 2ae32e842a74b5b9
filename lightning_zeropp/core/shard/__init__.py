"""Shard: how a stage's weights are spread over its data-parallel ranks. `fsdp` applies FSDP2's
`fully_shard` per block (and activation checkpointing); `plus` swaps in ZeRO++'s collectives
(`plus_comm`: quantized all-gathers and reduce-scatters, hpZ's node copy) built on `quant`'s
block quantizers. Reads settings and the mesh.

The names `lightning_zeropp.core.shard` held when it was one file are re-exported here.
"""

from lightning_zeropp.core.shard.fsdp import (
    apply_activation_checkpointing,
    local_shard,
    shard_stage,
)

__all__ = ["apply_activation_checkpointing", "local_shard", "shard_stage"]
