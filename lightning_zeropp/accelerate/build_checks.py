"""What `prepare_pipeline` (`accelerate.build`) checks and takes from the user's objects before
its first collective, on every rank alike: the `Accelerator` (a distributed type, mixed precision
and mesh the front can run under, and a process count that matches the launch), the layout
resolved for the world (a world of one process told how to start several), and the example
micro-batch the split checks its cut with, taken from the training loader.
"""

from __future__ import annotations

import os
from typing import Any

from accelerate import Accelerator, DistributedType
from torch.utils.data import DataLoader

from lightning_zeropp.accelerate.data import Unpack, example_microbatch, rows_per_rank
from lightning_zeropp.core.settings.config import ZeroPPLayout
from lightning_zeropp.core.settings.values import fields_of, setting_error
from lightning_zeropp.fronts.settings import RunSettings

__all__ = ["check_accelerator", "default_example", "example_rows", "resolve_layout"]

_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def check_accelerator(accelerator: Accelerator) -> None:
    kind = accelerator.distributed_type
    if kind not in _SUPPORTED:
        raise ValueError(
            f"Accelerator distributed_type={kind.value}: ZeroPP shards and pipelines the model "
            "itself. Launch without --use_fsdp / --use_deepspeed / --use_megatron_lm (plain "
            "torchrun or `accelerate launch --multi_gpu`) and set the layout with ZEROPP_* "
            "variables."
        )
    if accelerator.mixed_precision != "no":
        raise ValueError(
            f"Accelerator(mixed_precision={accelerator.mixed_precision!r}) autocasts prepared "
            "models only, and the pipeline stages are not prepared. Keep mixed_precision='no' and "
            "set ZeroPPPlugin(param_dtype='bf16') or ZEROPP_PARAM_DTYPE=bf16 (FSDP2 mixed "
            "precision, gradients reduced in fp32)."
        )
    if accelerator.parallelism_config is not None:
        raise ValueError(
            "Accelerator(parallelism_config=...) builds Accelerate's own mesh; ZeroPP builds a "
            "pp x dp_replicate x dp_shard mesh. Drop it and set ZEROPP_PP_SIZE, "
            "ZEROPP_DP_SHARD_SIZE, ZEROPP_DP_REPLICATE_SIZE."
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes == 1 and world > 1:
        raise ValueError(
            f"WORLD_SIZE={world} but the Accelerator runs a single process: on CPU, Accelerate "
            "sets up multi-process training only when its process state is first made with "
            "cpu=True: Accelerator(cpu=True) or ACCELERATE_USE_CPU=1, before anything else reads "
            "the state (a tracker built before the Accelerator does: call "
            "accelerate.PartialState(cpu=True) first)."
        )


def resolve_layout(settings: RunSettings, world_size: int) -> ZeroPPLayout:
    """The layout for the world; a world of one process gets the launch commands that start
    several (the usual cause of a layout that does not fit)."""
    try:
        return settings.resolve(world_size)
    except ValueError as err:
        if world_size != 1:
            raise
        raise setting_error(fields_of(err), f"{err}{_ONE_PROCESS}") from err


# `accelerate launch --cpu` starts one process whatever --num_processes says (its CPU launcher
# is not the distributed one): naming it here would send the user back to the same command.
_ONE_PROCESS = (
    " Only one process was started. On CPUs start several with `torchrun --nproc_per_node N "
    "script.py`, or `accelerate launch --multi_gpu --num_processes N script.py` with "
    "Accelerator(cpu=True) (plain `accelerate launch --cpu` starts one); on GPUs with "
    "`accelerate launch --multi_gpu --num_processes N script.py` or torchrun."
)


def example_rows(
    accelerator: Accelerator, train_dl: DataLoader, config: ZeroPPLayout
) -> int | None:
    return rows_per_rank(train_dl, accelerator.split_batches, config.dp_size)


def default_example(
    accelerator: Accelerator, train_dl: DataLoader | None, config: ZeroPPLayout, unpack: Unpack
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    rows = None
    if train_dl is not None:
        rows = rows_per_rank(train_dl, accelerator.split_batches, config.dp_size)
    if rows is None:
        raise ValueError(
            "the split needs one example micro-batch of model inputs, and there is no "
            "training loader with a batch size to take it from: pass example_args=(...) (one "
            "micro-batch, per-rank rows / num_microbatches), or split='stack'."
        )
    assert train_dl is not None  # rows came from it
    return example_microbatch(train_dl, rows // config.num_microbatches, unpack)
