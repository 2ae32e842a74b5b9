"""What both recipes share: checking the composed `conf/` config, and one run directory per run.

Every rank runs this before anything distributed exists, so a bad setting fails on every rank at
once with a message that names the config key (`trainer.max_steps=-1 must be ...`), instead of
some ranks waiting in a collective for others that died.

Run directory: every rank composes its own config, and they all land in one run directory keyed
on an id they share (see conf/config.yaml). Only global rank 0 writes Hydra's files there:
`rank_zero_overrides` turns off `.hydra/` and the job log file for every other rank, whoever
launched it (torchrun, SLURM's srun, or Lightning re-running the script for its other ranks).

Hydra and OmegaConf stay in `recipes/` and `conf/` (and the planner's command line,
`python -m lightning_zeropp.plan`); importing the library never imports them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_zeropp import ZeroPPConfig

__all__ = [
    "CONF_DIR",
    "Plan",
    "build_datasets",
    "check_config",
    "check_model_facts",
    "fill_model_facts",
    "is_rank_zero",
    "parallel_settings",
    "plan_summary",
    "rank_zero_overrides",
    "run_dir_note",
]

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

# Variables that say "not the first process" under each launcher: torchrun (RANK, LOCAL_RANK,
# GROUP_RANK), SLURM's srun (SLURM_PROCID), Lightning's launcher (LOCAL_RANK, NODE_RANK).
_RANK_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "SLURM_PROCID")
_ACCELERATORS = ("cpu", "gpu", "cuda")
_OPTIMIZERS = ("adamw", "sgd")
_PRECISIONS = ("32-true", "32", 32)


def is_rank_zero(env: Mapping[str, str] = os.environ) -> bool:
    """True unless a launcher variable says this process is not global rank 0."""
    return all(env.get(var, "0") in ("0", "") for var in _RANK_VARS)


def rank_zero_overrides(argv: Sequence[str], env: Mapping[str, str] = os.environ) -> list[str]:
    """Hydra overrides that keep a process other than global rank 0 from writing files.

    Rank 0 writes `.hydra/` (the composed config and overrides) and the job log; the others
    write neither (`hydra.output_subdir=null`, console-only job logging). Lightning's launcher
    already passes `hydra.output_subdir=null` to its children; what is already set is not
    repeated.
    """
    if is_rank_zero(env):
        return []
    wanted = {"hydra.output_subdir": "null", "hydra/job_logging": "stdout"}
    given = {arg.split("=", 1)[0].lstrip("+~") for arg in argv}
    return [f"{key}={value}" for key, value in wanted.items() if key not in given]


def run_dir_note(env: Mapping[str, str] = os.environ) -> str | None:
    """A warning when the run directory's id is shared across runs, not only across ranks.

    torchrun's static rendezvous (multi-node `--node-rank`/`--master-addr`, or `--master-port`)
    reports the run id "none", so every such run would write into outputs/none.
    """
    if env.get("TORCHELASTIC_RUN_ID") == "none":
        return (
            "torchrun gave no rendezvous id (static rendezvous): this run writes into "
            "outputs/none like every other such run. Pass --rdzv-id <unique id> (e.g. the "
            "scheduler's job id) or hydra.run.dir=<dir>."
        )
    return None


@dataclass(frozen=True)
class Plan:
    """The layout a checked config resolves to on its cluster."""

    world_size: int
    zeropp: ZeroPPConfig  # resolved against world_size
    parallel: dict[str, Any]  # the parallel group as ZeroPPConfig keyword arguments
    micro_batch_size: int
    rank_batch_size: int  # rows per data-parallel rank and step
    global_batch_size: int

    @property
    def dp_size(self) -> int:
        return self.zeropp.dp_size


def load_source(cfg: DictConfig) -> str | None:
    """Where the fronts read the weights of a model built empty from a directory (hf_local with
    `net.empty`): each rank its own shards. None when the model is built with its weights."""
    net = cfg.model.net
    return str(net.path) if net.get("empty") and net.get("path") else None


def check_config(cfg: DictConfig) -> Plan:
    """Check every group of a composed config; return the layout. Raises ValueError naming the key.

    Model facts only known once a model is built (hf_local's vocabulary and depth) are checked
    again by `check_model_facts`.
    """
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError(
            f"missing required value(s): {', '.join(missing)}; give them on the command line, "
            f"e.g. {missing[0]}=..."
        )
    world = _check_cluster(cfg.cluster)
    _check_trainer(cfg.trainer)
    parallel = parallel_settings(cfg.parallel, world)
    auto = parallel.pop("auto", None)
    if auto is not None:
        parallel = auto_layout(cfg, world, parallel, auto)
    zeropp = _resolve(parallel, world, cfg)
    _positive_int("data.seq_len", cfg.data.seq_len)
    check_model_facts(cfg, zeropp)
    micro = cfg.trainer.micro_batch_size
    rank_batch = micro * zeropp.num_microbatches
    return Plan(
        world_size=world,
        zeropp=zeropp,
        parallel=parallel,
        micro_batch_size=micro,
        rank_batch_size=rank_batch,
        global_batch_size=rank_batch * zeropp.dp_size,
    )


def parallel_settings(parallel: DictConfig, world_size: int) -> dict[str, Any]:
    """The `parallel` group as ZeroPPConfig keyword arguments.

    Every key must be a ZeroPPConfig field. `dp_replicate_size: null` means "the rest of the
    world" (ZeroPPConfig itself fills only `dp_shard_size` that way), so a config can say
    "replicate over everything" (DDP) without knowing the world size.
    """
    settings = OmegaConf.to_container(parallel, resolve=True)
    assert isinstance(settings, dict)
    fields = [f.name for f in dataclasses.fields(ZeroPPConfig)] + ["auto"]
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise ValueError(
            f"parallel.{unknown[0]} is not a ZeroPPConfig setting; the parallel group takes "
            f"{fields}."
        )
    if settings.get("dp_replicate_size", 1) is None:
        pp = settings.get("pp_size") or 1
        shard = settings.get("dp_shard_size")
        if shard is None:
            raise ValueError(
                "parallel.dp_replicate_size=null (the rest of the world) needs "
                "parallel.dp_shard_size set; at most one of them may be null."
            )
        if not all(isinstance(v, int) and v > 0 for v in (pp, shard)):
            raise ValueError(
                f"parallel.pp_size={pp!r} and parallel.dp_shard_size={shard!r} must be positive "
                "integers."
            )
        settings["dp_replicate_size"] = max(world_size // (pp * shard), 1)
    return settings


def check_model_facts(cfg: DictConfig, zeropp: ZeroPPConfig) -> None:
    """Checks that need the model's vocabulary size, depth and positional range (once known)."""
    model = cfg.model
    vocab, layers = model.get("vocab_size"), model.get("num_layers")
    limit = model.get("max_seq_len")
    if limit is not None and cfg.data.seq_len > limit:
        raise ValueError(
            f"data.seq_len={cfg.data.seq_len} is longer than model.max_seq_len={limit} (its "
            "positional range); use a shorter data.seq_len."
        )
    if vocab is not None:
        _positive_int("model.vocab_size", vocab)
    if layers is not None:
        _positive_int("model.num_layers", layers)
        if zeropp.num_stages > layers:
            raise ValueError(
                f"parallel.pp_size={zeropp.pp_size} x num_chunks={zeropp.num_chunks} = "
                f"{zeropp.num_stages} pipeline stages, but model.num_layers={layers}: every stage "
                "needs at least one block. Use fewer stages or a deeper model."
            )


def fill_model_facts(model_cfg: DictConfig, net: Any) -> None:
    """Fill a config's unknown vocabulary size and depth (hf_local) from the built model."""
    config = getattr(net, "config", None) or getattr(net, "cfg", None)
    facts = {
        "vocab_size": getattr(config, "vocab_size", None),
        "num_layers": getattr(config, "num_hidden_layers", getattr(config, "num_layers", None)),
        "max_seq_len": getattr(config, "max_position_embeddings", None),
    }
    with open_dict(model_cfg):
        for key, value in facts.items():
            if model_cfg.get(key) is None and value is not None:
                model_cfg[key] = int(value)


def build_datasets(cfg: DictConfig) -> tuple[Any, Any]:
    """The `data` group's train and validation datasets, checked against the model's vocabulary."""
    from hydra.utils import instantiate

    train, val = instantiate(cfg.data.train), instantiate(cfg.data.val)
    for split, dataset in (("train", train), ("val", val)):
        tokens = getattr(dataset, "tokens", None)
        vocab = cfg.model.vocab_size
        if tokens is not None and vocab is not None and len(tokens) and int(tokens.max()) >= vocab:
            raise ValueError(
                f"data={cfg.data.name}: the {split} split holds token id {int(tokens.max())}, but "
                f"model.vocab_size={vocab}; use a tokenizer that matches the model "
                "(data.tokenizer=...) or a model with a larger vocabulary."
            )
    return train, val


def plan_summary(cfg: DictConfig, plan: Plan, num_params: int) -> str:
    """What this layout costs, from the cluster's documented bandwidths (information only).

    Model states: fp32 weights, gradients and two Adam moments = 16 bytes per parameter, sharded
    over pp_size x dp_shard_size ranks (replicated over dp_replicate_size). One all-gather of a
    stage's weights moves (dp_shard - 1) / dp_shard of them over the slowest link the shard group
    spans (NVLink inside a node, InfiniBand when it straddles nodes), as INT8 plus one fp32 scale
    per block under `quantized_weights="int8"` (ZeRO++'s qwZ).
    """
    z, cluster = plan.zeropp, cfg.cluster
    assert z.dp_shard_size is not None and z.pp_size is not None
    lines = [
        f"cluster {cluster.name}: world {plan.world_size} = {cluster.devices} devices x "
        f"{cluster.num_nodes} node(s); layout pp {z.pp_size} x dp_replicate "
        f"{z.dp_replicate_size} x dp_shard {z.dp_shard_size}, schedule {z.schedule}, "
        f"{z.num_chunks} chunk(s) per rank, {z.num_microbatches} micro-batches of "
        f"{plan.micro_batch_size} rows (global batch {plan.global_batch_size})",
        f"model {cfg.model.name}: {num_params / 1e6:.1f}M parameters; model states about "
        f"{16 * num_params / (z.pp_size * z.dp_shard_size) / 2**30:.2f} GiB per rank",
    ]
    bandwidth = cluster.get("bandwidth_GBps") or {}
    inside = z.dp_shard_size <= cluster.devices
    link = bandwidth.get("intra_node" if inside else "inter_node")
    if link and z.dp_shard_size > 1:
        weight_bytes = 2 if str(z.param_dtype) in ("torch.bfloat16", "torch.float16") else 4
        if z.quantized_weights == "int8":
            weight_bytes = 1 + 4 / z.quant_block_size
        moved = num_params / z.pp_size * weight_bytes * (z.dp_shard_size - 1) / z.dp_shard_size
        via = ("NVLink" if inside else "InfiniBand") if cluster.accelerator == "gpu" else "gloo"
        lines.append(
            f"one stage all-gather: {moved / 1e9:.2f} GB over {via} at {link} GB/s = "
            f"{1e3 * moved / (link * 1e9):.1f} ms"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- checks
def _check_cluster(cluster: DictConfig) -> int:
    if cluster.accelerator not in _ACCELERATORS:
        raise ValueError(
            f"cluster.accelerator={cluster.accelerator!r} is unknown; use one of {_ACCELERATORS}."
        )
    _positive_int("cluster.devices", cluster.devices)
    _positive_int("cluster.num_nodes", cluster.num_nodes)
    return cluster.devices * cluster.num_nodes


def _check_trainer(trainer: DictConfig) -> None:
    for key in ("max_steps", "micro_batch_size", "log_every_n_steps", "val_check_interval"):
        _positive_int(f"trainer.{key}", trainer[key])
    _non_negative_int("trainer.warmup_steps", trainer.warmup_steps)
    _int("trainer.seed", trainer.seed)
    if trainer.limit_val_batches is not None:
        _positive_int("trainer.limit_val_batches", trainer.limit_val_batches)
    if trainer.optimizer not in _OPTIMIZERS:
        raise ValueError(
            f"trainer.optimizer={trainer.optimizer!r} is unknown; use one of {_OPTIMIZERS}."
        )
    _positive_number("trainer.lr", trainer.lr)
    _number("trainer.weight_decay", trainer.weight_decay, minimum=0.0)
    if trainer.gradient_clip_val is not None:
        _positive_number("trainer.gradient_clip_val", trainer.gradient_clip_val)
    if trainer.precision not in _PRECISIONS:
        raise ValueError(
            f"trainer.precision={trainer.precision!r}: ZeroPP runs the Trainer in '32-true'. For "
            "bf16 keep trainer.precision=32-true and set parallel.param_dtype=bf16 (FSDP2 mixed "
            "precision, gradients reduced in fp32)."
        )


def auto_layout(
    cfg: DictConfig, world: int, settings: dict[str, Any], auto: Mapping[str, Any]
) -> dict[str, Any]:
    """`parallel=auto`: the layout the planner predicts fastest among those that fit the
    cluster's memory, for `auto.global_batch_size` rows a step in micro-batches of
    `trainer.micro_batch_size`. Every rank computes the same answer (figures from the cluster
    file, nothing measured), before any process group exists."""
    import torch
    from hydra.utils import instantiate

    from lightning_zeropp.core.settings.config import parse_dtype
    from lightning_zeropp.core.split.blocks import find_blocks
    from lightning_zeropp.plan import Hardware
    from lightning_zeropp.plan.search import enumerate_layouts, search

    rows = auto.get("global_batch_size")
    _positive_int("parallel.auto.global_batch_size", rows)
    micro = cfg.trainer.micro_batch_size
    base = {k: v for k, v in settings.items() if v is not None and k not in _LAYOUT_KEYS}
    cluster = OmegaConf.to_container(cfg.cluster, resolve=True)
    assert isinstance(cluster, dict)
    computes = parse_dtype(base.get("param_dtype"), "parallel.param_dtype")
    dtype = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(computes, "fp32")
    hardware = Hardware.from_cluster(cluster, dtype)
    with torch.device("meta"):
        model = instantiate(cfg.model.net)
    layouts = list(
        enumerate_layouts(
            world, len(find_blocks(model)[1]), rows, hardware.node_size, base, micro_batch=micro
        )
    )
    if not layouts:
        raise ValueError(
            f"parallel=auto: {rows} rows a step (parallel.auto.global_batch_size) do not split "
            f"into micro-batches of trainer.micro_batch_size={micro} on {world} ranks in any "
            "layout; use a multiple of micro_batch_size x the data-parallel size (e.g. "
            f"{micro * world})."
        )
    best = search(
        model, world, rows, cfg.data.seq_len, hardware, layouts=layouts, top=1,
        optimizer=cfg.trainer.optimizer,
    )  # fmt: skip
    if not best:
        raise ValueError(
            f"parallel=auto: no layout of {len(layouts)} trains {rows} rows a step in micro-batches "
            f"of trainer.micro_batch_size={micro} within {cluster['name']}'s memory "
            f"({(hardware.memory_bytes or 0) / 2**30:.1f} GiB per rank): lower "
            "parallel.auto.global_batch_size or trainer.micro_batch_size, or add devices."
        )
    return best[0].settings


# The keys parallel=auto chooses (the others in the parallel group are kept as given).
_LAYOUT_KEYS = (
    "pp_size", "dp_shard_size", "dp_replicate_size", "num_microbatches", "schedule", "num_chunks",
    "unit_size", "activation_checkpointing", "split_backward",
)  # fmt: skip


def _resolve(parallel: dict[str, Any], world: int, cfg: DictConfig) -> ZeroPPConfig:
    try:
        return ZeroPPConfig(**parallel).resolve(world)
    except ValueError as err:
        raise ValueError(
            f"parallel settings do not fit cluster={cfg.cluster.name} (world {world} = "
            f"cluster.devices {cfg.cluster.devices} x cluster.num_nodes "
            f"{cfg.cluster.num_nodes}): {err}"
        ) from None


def _int(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key}={value!r} must be an integer.")


def _positive_int(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{key}={value!r} must be a positive integer.")


def _non_negative_int(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{key}={value!r} must be a non-negative integer.")


def _number(key: str, value: Any, minimum: float) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum:
        raise ValueError(f"{key}={value!r} must be a finite number >= {minimum}.")


def _positive_number(key: str, value: Any) -> None:
    _number(key, value, minimum=0.0)
    if value == 0:
        raise ValueError(f"{key}={value!r} must be positive.")
