"""ZeRO++ priced: what qwZ, hpZ and qgZ (`core.shard.plus`, `core.shard.plus_comm`) move, and
what memory they hold, per FSDP unit, from its parameters' shapes.

- qwZ (`quantized_weights`): a unit's forward all-gather moves each rank's shard packed by
  `core.shard.quant.BlockCodec`: a 2-D parameter's padded shard as INT8 plus one fp32 scale per
  `quant_block_size` elements; a 1-D one raw, in the compute dtype ("bf16": every value as bf16;
  "fp": every value raw). Buffers while it runs: the packed shard and the k packed rows gathered.
- hpZ (`hpz_partition_size` k): after forward each rank keeps 1/k of the unit (the secondary
  copy, in the compute dtype); a backward gather then runs over those k ranks of one node, raw.
- qgZ (`quantized_gradients`): a unit's reduce-scatter is two all-to-alls of packed rows (in the
  reduce dtype when unquantized): inside the node, each rank sends its node mates their rows (k
  rows of the unit's shard width, `local` - 1 of them away), then across nodes the summed rows
  of its local index (`nodes` rows, `nodes` - 1 away). Buffers while it runs: the rows in fp32,
  packed, received and decoded; with error feedback, each hop keeps its rows' error in fp32 from
  step to step (k rows and `nodes` rows of the unit).
ZeRO++'s comms are installed only where the shard group has more than one rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.settings.plus import hpz_size

__all__ = ["UnitTraffic", "plus_memory", "unit_traffic"]

Shapes = Sequence[tuple[int, ...]]
BITS = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class UnitTraffic:
    """One FSDP unit's collectives, per rank: bytes this rank hands each call."""

    gather: int  # a gather over the shard group (qwZ's packed shard, or FSDP's raw one)
    node_gather: int  # a gather of hpZ's secondary copy over its k ranks (0 without hpZ)
    reduce: int  # FSDP's reduce-scatter over the shard group (0 under qgZ)
    intra: int  # qgZ's all-to-all inside the node (0 without it, or with one rank a node)
    cross: int  # qgZ's all-to-all across nodes (0 without it, or inside one node)
    buffers: int  # the most the unit's ZeRO++ comms allocate while one runs


def _elem(dtype: torch.dtype | None, default: int) -> int:
    return dtype.itemsize if dtype else default


def _padded(shape: tuple[int, ...], shards: int) -> int:
    return math.ceil(shape[0] / shards) * math.prod(shape[1:]) if shape else 1


def _packed(shapes: Shapes, shards: int, bits: int | None, block: int, raw: int) -> int:
    """`BlockCodec.width_bytes` of one row: each parameter's padded shard, quantized when 2-D."""
    total = 0
    for shape in shapes:
        n = _padded(shape, shards)
        if bits is None or len(shape) < 2:
            total += n * raw
        else:
            total += (n if bits == 8 else math.ceil(n / 2)) + 4 * math.ceil(n / block)
    return total


def unit_traffic(cfg: ZeroPPLayout, shapes: Shapes) -> UnitTraffic:
    """What a unit of parameters `shapes` moves under a resolved config's ZeRO++ settings."""
    k = cfg.dp_shard_size or 1
    node = min(k, cfg.node_size or k)
    nodes, local = k // node, node
    compute = _elem(cfg.param_dtype, 4)
    reduce_dtype = cfg.reduce_dtype or (torch.float32 if cfg.param_dtype else None)
    reduce = _elem(reduce_dtype, compute)
    width = sum(_padded(s, k) for s in shapes)
    custom = k > 1 and bool(shapes)
    gather, buffers = width * compute, 0
    if custom and cfg.quantized_weights is not None:
        raw = 2 if cfg.quantized_weights == "bf16" else compute
        gather = _packed(shapes, k, BITS.get(cfg.quantized_weights), cfg.quant_block_size, raw)
        buffers = (k + 1) * gather
    copy = hpz_size(cfg)
    node_gather = sum(_padded(s, copy) for s in shapes) * compute if copy and shapes else 0
    fsdp_reduce, intra, cross = k * width * reduce if k > 1 and shapes else 0, 0, 0
    if custom and cfg.quantized_gradients is not None:
        bits = BITS.get(cfg.quantized_gradients)
        row = _packed(shapes, k, bits, cfg.quant_block_size, reduce)
        intra = k * row if local > 1 else 0
        cross = nodes * row if nodes > 1 else 0
        fsdp_reduce = 0
        # rows in fp32, packed and received, decoded in fp32
        buffers = max(buffers, 2 * k * width * 4 + 2 * k * row)
    return UnitTraffic(gather, node_gather, fsdp_reduce, intra, cross, buffers)


def plus_memory(cfg: ZeroPPLayout, units: Sequence[Shapes]) -> int:
    """Bytes ZeRO++ holds on a rank whose stages have FSDP units `units`: hpZ's secondary copy
    of every unit (at most, all at once), qgZ's error-feedback rows, and the largest transient
    buffers of one unit's comms."""
    k = cfg.dp_shard_size or 1
    compute = _elem(cfg.param_dtype, 4)
    copy = hpz_size(cfg)
    total = sum(sum(_padded(s, copy) for s in u) * compute for u in units) if copy else 0
    if cfg.quantized_gradients is not None and cfg.gradient_error_feedback and k > 1:
        node = min(k, cfg.node_size or k)
        nodes, local = k // node, node
        for u in units:
            width = sum(_padded(s, k) for s in u)
            total += 4 * width * ((k if local > 1 else 0) + (nodes if nodes > 1 else 0))
    return total + max((unit_traffic(cfg, u).buffers for u in units if u), default=0)
