"""Checking ZeRO++'s and offload's settings of a `ZeroPPConfig` (called by `resolve`).

The switches (one per technique; `core.shard.plus` applies them):
- `quantized_weights`: None (FSDP's own all-gather), "int8" (qwZ), "bf16" (weights travel as
  bf16 and are computed with in their own dtype: bf16's gather volume with fp32 compute), or
  "fp" (the same custom collective at full precision: it moves what FSDP's does, and exists to
  check layouts);
- `hpz_partition_size`: None, or k ranks (usually `node_size`) that keep a second copy of the
  weights after forward, so backward gathers stay inside those k ranks (hpZ); resolved to None
  where the shard group already lies inside one node (nothing to do);
- `quantized_gradients`: None, "int8", "int4" (qgZ, a two-hop all-to-all), or "fp";
- `gradient_error_feedback`: carry each hop's quantization error into the next step (default on
  for INT4, off otherwise);
- `quant_block_size`: elements per quantization block (blocks never straddle parameters);
- `cpu_offload`: FSDP2's CPU offload of parameters, gradients and optimizer state;
- `node_size`: ranks per node (a node is that many consecutive ranks); default the launcher's
  (`LOCAL_WORLD_SIZE`, read by the fronts and passed to `resolve`), else the whole world.
"""

from __future__ import annotations

from typing import Any

from lightning_zeropp.core.settings.values import setting_error

__all__ = ["WEIGHT_MODES", "GRADIENT_MODES", "resolve_plus", "hpz_size", "shard_group_size"]

WEIGHT_MODES = (None, "fp", "bf16", "int8")
GRADIENT_MODES = (None, "fp", "int8", "int4")
_OFF = ("", "none", "null", "off", "false")


def _mode(name: str, value: Any, modes: tuple[str | None, ...]) -> str | None:
    if value is None or value is False or str(value).strip().lower() in _OFF:
        return None
    mode = str(value).strip().lower()
    if mode not in modes:
        raise setting_error(
            name, f"{name}={value!r} is unknown; choose one of {list(modes)} (None turns it off)."
        )
    return mode


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise setting_error(name, f"{name}={value!r} must be a positive integer.")
    return value


def resolve_plus(cfg: Any, world_size: int) -> None:
    """Fill in and check the ZeRO++ fields of a `ZeroPPConfig` whose sizes are resolved."""
    cfg.quantized_weights = _mode("quantized_weights", cfg.quantized_weights, WEIGHT_MODES)
    cfg.quantized_gradients = _mode("quantized_gradients", cfg.quantized_gradients, GRADIENT_MODES)
    _positive("quant_block_size", cfg.quant_block_size)
    cfg.cpu_offload = bool(cfg.cpu_offload)
    _positive("node_size", cfg.node_size)
    if world_size % cfg.node_size:
        raise setting_error(
            "node_size",
            f"node_size={cfg.node_size} does not divide the world ({world_size} processes); a node "
            "is node_size consecutive ranks. Set node_size to the processes per node.",
        )
    if cfg.gradient_error_feedback is None:
        cfg.gradient_error_feedback = cfg.quantized_gradients == "int4"
    elif cfg.gradient_error_feedback and cfg.quantized_gradients not in ("int8", "int4"):
        raise setting_error(
            ("gradient_error_feedback", "quantized_gradients"),
            "gradient_error_feedback=True needs quantized_gradients='int8' or 'int4' (got "
            f"{cfg.quantized_gradients!r}): there is no quantization error to feed back.",
        )
    _check_hpz(cfg)
    _check_gradients(cfg)


def hpz_size(cfg: Any) -> int | None:
    """k when hpZ changes anything in a resolved config: on, and smaller than the shard group."""
    k = cfg.hpz_partition_size
    return k if k is not None and k < shard_group_size(cfg) else None


def shard_group_size(cfg: Any) -> int:
    """Ranks FSDP shards a stage's weights over: dp_shard, times cp under context parallelism
    (its ranks hold one sequence's parts and share the weights' shards, as torchtitan does)."""
    return (cfg.dp_shard_size or 1) * (getattr(cfg, "cp_size", 1) or 1)


def _shard_name(cfg: Any) -> str:
    """The shard group as a message names it."""
    cp = getattr(cfg, "cp_size", 1) or 1
    if cp > 1:
        return f"dp_shard_size x cp_size = {cfg.dp_shard_size} x {cp}"
    return f"dp_shard_size={cfg.dp_shard_size}"


def _check_hpz(cfg: Any) -> None:
    k = cfg.hpz_partition_size
    if k is None:
        return
    _positive("hpz_partition_size", k)
    if k == 1:
        raise setting_error(
            "hpz_partition_size",
            "hpz_partition_size=1 would keep a whole copy of the weights on every rank after "
            "forward; that is reshard_after_forward=False. Use the node size (e.g. 8).",
        )
    shard, node = shard_group_size(cfg), cfg.node_size
    if k % shard == 0 and node % shard == 0:
        # The whole shard group already lies inside one node (or k is the group): backward
        # gathers cannot leave the node, so there is nothing for hpZ to do.
        cfg.hpz_partition_size = None
        return
    if shard % k or node % k:
        raise setting_error(
            ("hpz_partition_size", "dp_shard_size", "node_size"),
            f"hpz_partition_size={k} must divide {_shard_name(cfg)} and node_size={node} "
            "(its ranks must lie inside one node, or backward gathers would still cross nodes); "
            f"use hpz_partition_size={min(shard, node)} if that divides both.",
        )
    if cfg.dp_replicate_size > 1:
        raise setting_error(
            ("hpz_partition_size", "dp_replicate_size"),
            f"hpz_partition_size={k} with dp_replicate_size={cfg.dp_replicate_size}: hpZ is "
            "ZeRO++'s alternative to replicating per node (FSDP2 keeps its secondary copy only "
            "over a 1-D shard mesh). Use dp_replicate_size=1 with dp_shard over all data ranks.",
        )


def _check_gradients(cfg: Any) -> None:
    if cfg.quantized_gradients is None:
        return
    if cfg.dp_replicate_size > 1:
        raise setting_error(
            ("quantized_gradients", "dp_replicate_size"),
            f"quantized_gradients={cfg.quantized_gradients!r} with dp_replicate_size="
            f"{cfg.dp_replicate_size}: FSDP2's cross-replica all-reduce cannot be replaced, so the "
            "cross-node step would not be quantized. Use dp_replicate_size=1 (ZeRO-3 over all "
            "data-parallel ranks, ZeRO++'s layout): the two-hop reduction then crosses nodes.",
        )
    shard, node = shard_group_size(cfg), cfg.node_size
    if shard % node and node % shard:
        raise setting_error(
            ("quantized_gradients", "dp_shard_size", "node_size"),
            f"quantized_gradients needs the shard group ({_shard_name(cfg)}) to hold whole "
            f"nodes or lie inside one (node_size={node}); choose sizes where one divides the other.",
        )
