"""What a `TrainingArguments` asks of a pipeline: the settings it maps to, and what is refused.

Everything here reads the Trainer's arguments only, so every rank refuses the same run, at
construction, before any collective. A refusal says why the option cannot be pipelined exactly
and what to use instead; options that map onto ZeroPP (`bf16=True`) are mapped, not refused.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin

from lightning_zeropp.accelerate.settings import ZeroPPPlugin
from lightning_zeropp.core.settings.values import parse_dtype

__all__ = ["accelerator_arguments", "check_trainer_arguments", "plugin_for"]

_LOADER_SETTINGS = ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler")
# The Trainer's optimizers that were run on the pipeline's sharded parameters and give one
# process's numbers (tests/distributed/test_trainer.py): torch's elementwise optimizers.
TESTED_OPTIMS = ("adamw_torch", "adamw_torch_fused", "sgd", "rmsprop")
# Why the others are refused, where it is known; the rest are simply untested.
_OPTIM_REASONS = {
    "adafactor": (
        "Adafactor factorizes each weight matrix's second moment into its row and column means "
        "over the whole matrix, but each rank steps its FSDP2 shard of the matrix (a DTensor), "
        "so the factors could not be the whole matrix's"
    ),
    "adagrad": (
        "torch's Adagrad makes its state when it is built, on the whole model, and the pipeline "
        "rebuilds the optimizer over its stages' shards (state cannot move onto them)"
    ),
    "galore": "GaLore projects each whole weight matrix's gradient, which a rank holds a shard of",
    "apollo": "APOLLO projects each whole weight matrix's gradient, which a rank holds a shard of",
    "lomo": "LOMO fuses the update into the backward of the whole model, not the pipeline's",
    "bnb": "bitsandbytes' optimizers keep block-quantized states over plain tensors, not shards",
    "8bit": "quantized optimizer states are kept in blocks that do not follow FSDP2's shards",
    "4bit": "quantized optimizer states are kept in blocks that do not follow FSDP2's shards",
}


def check_trainer_arguments(args: Any, init: dict[str, Any]) -> None:
    """Raise `ValueError` for what `Trainer(args=args, **init)` does that the pipeline cannot."""
    for problem in _problems(args, init):
        raise ValueError(f"ZeroPPTrainer: {problem}")


def _problems(args: Any, init: dict[str, Any]) -> list[str]:
    found = []
    if init.get("model_init") is not None:
        found.append(
            "model_init= rebuilds the model for every train() and hyperparameter trial; the "
            "pipeline is built once from one model. Pass model=... instead."
        )
    if args.fp16 or args.fp16_full_eval:
        found.append(
            "fp16 needs a loss scaler, which a pipeline's fused forward and backward does not "
            "run. Use bf16=True (FSDP2 mixed precision: bf16 compute, fp32 gradient reduction)."
        )
    if args.bf16_full_eval:
        found.append(
            "bf16_full_eval=True casts the whole model for evaluation; the pipeline evaluates "
            "with its training precision. Drop it (bf16=True computes evaluation in bf16 too)."
        )
    if args.fsdp:
        found.append(
            f"fsdp={args.fsdp!r}: ZeroPP shards every pipeline stage with FSDP2 itself. Drop the "
            "fsdp arguments and set the layout with ZeroPPPlugin(...) or ZEROPP_* variables."
        )
    if args.deepspeed:
        found.append(
            "deepspeed=...: ZeroPP shards and pipelines the model itself. Drop deepspeed and set "
            "the layout with ZeroPPPlugin(...) or ZEROPP_* variables."
        )
    if args.parallelism_config is not None:
        found.append(
            "parallelism_config=... builds Accelerate's own mesh; ZeroPP builds a pp x "
            "dp_replicate x dp_shard mesh. Drop it and use ZeroPPPlugin(pp_size=..., "
            "dp_shard_size=..., dp_replicate_size=...)."
        )
    if args.torch_compile:
        found.append(
            "torch_compile=True compiles the whole model; the pipeline runs stage copies of it. "
            "Drop torch_compile."
        )
    checkpointing = _checkpointing_problem(args)
    if checkpointing:
        found.append(checkpointing)
    if args.auto_find_batch_size:
        found.append(
            "auto_find_batch_size=True rebuilds the training loop on out-of-memory errors, which "
            "would leave the pipeline's ranks out of step. Set per_device_train_batch_size."
        )
    if args.neftune_noise_alpha is not None:
        found.append(
            "neftune_noise_alpha hooks the model's input embedding before training; the pipeline "
            "trains stage copies of it, so the noise would be silently lost. Drop it."
        )
    if args.use_liger_kernel:
        found.append(
            "use_liger_kernel=True patches the model's modules, and its fused loss reads the "
            "head's weights outside the last stage. Drop it."
        )
    optim = _optim_problem(args, init)
    if optim:
        found.append(optim)
    if args.save_on_each_node:
        found.append(
            "save_on_each_node=True writes a copy per node; the sharded checkpoint has each rank "
            "write its own shards into one folder, on a filesystem every rank shares. Drop it."
        )
    if args.train_sampling_strategy == "batch_rebalance":
        found.append(
            "train_sampling_strategy='batch_rebalance' balances rows over every process; the "
            "ranks of one pipeline share a batch. Use 'random', 'sequential' or "
            "'group_by_length'."
        )
    if not args.average_tokens_across_devices:
        found.append(
            "average_tokens_across_devices=False averages per-process means, but the processes "
            "of one pipeline share their rows: there is no per-process batch to average. Keep "
            "the default True: the loss is the global batch's mean over labelled tokens, as "
            "one process computes it."
        )
    return found


def _checkpointing_problem(args: Any) -> str | None:
    """What of the Trainer's activation checkpointing cannot be mapped onto the library's."""
    if not _asks_checkpointing(args):
        return None
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None) or {})
    kwargs.update(getattr(args, "gradient_checkpointing_kwargs", None) or {})
    odd = {}
    if kwargs.get("every_n_layers", 1) != 1:
        odd["every_n_layers"] = kwargs["every_n_layers"]
    if not odd:
        return None
    return (
        f"activation_checkpointing_kwargs={odd}: the pipeline recomputes each stage's blocks "
        "itself (ZeroPPPlugin(activation_checkpointing=True or 'except_last')), every block. "
        "Drop these keys."
    )


def _asks_checkpointing(args: Any) -> bool:
    # `activation_checkpointing` is the name since transformers 5.x; `gradient_checkpointing`
    # its older alias (TRL's SFTConfig sets it by default)
    return bool(getattr(args, "activation_checkpointing", False) or args.gradient_checkpointing)


def _optim_problem(args: Any, init: dict[str, Any]) -> str | None:
    """Why `args.optim` cannot be pipelined exactly, or None (also when the Trainer is handed
    its optimizer: `optimizers=` or `optimizer_cls_and_kwargs=`)."""
    if init.get("optimizers", (None, None))[0] is not None or init.get("optimizer_cls_and_kwargs"):
        return None
    name = str(getattr(args.optim, "value", args.optim))
    if name in TESTED_OPTIMS:
        return None
    reason = next((why for key, why in _OPTIM_REASONS.items() if key in name), None)
    why = reason or "it has not been checked to give one process's numbers on FSDP2's shards"
    return (
        f"optim={name!r}: {why}. Use one of {', '.join(TESTED_OPTIMS)} (optim=...), or hand the "
        "Trainer an elementwise torch optimizer (optimizers=(optimizer, None))."
    )


def plugin_for(plugin: ZeroPPPlugin | None, args: Any) -> ZeroPPPlugin:
    """The plugin the Trainer's accelerator uses: `plugin` (default: ZEROPP_* variables) with
    `bf16=True` as FSDP2 mixed precision (bf16 parameters in compute, fp32 reduction), and
    `gradient_checkpointing=True` as the library's activation checkpointing (the Trainer's own
    would patch the model's layers before the pipeline cuts them: it is turned off in `args`)."""
    plugin = plugin or ZeroPPPlugin()
    if _asks_checkpointing(args):
        kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None) or {})
        kwargs.update(getattr(args, "gradient_checkpointing_kwargs", None) or {})
        plugin = _with_checkpointing(plugin, bool(kwargs.get("offload", False)))
        args.activation_checkpointing = args.gradient_checkpointing = False
    if not args.bf16:
        return plugin
    config = plugin.run_settings().config  # what the run gets: code, then ZEROPP_* variables
    if parse_dtype(config.param_dtype, "param_dtype") not in (None, torch.bfloat16):
        raise ValueError(
            f"ZeroPPTrainer: TrainingArguments(bf16=True) and param_dtype="
            f"{config.param_dtype!r} (ZeroPPPlugin or ZEROPP_PARAM_DTYPE) disagree; drop one."
        )
    reduce = config.reduce_dtype if config.reduce_dtype is not None else torch.float32
    mapped = copy.copy(plugin)
    if plugin.config is not None:
        mapped.config = dataclasses.replace(
            plugin.config, param_dtype=torch.bfloat16, reduce_dtype=reduce
        )
    else:
        mapped.settings = {**plugin.settings, "param_dtype": torch.bfloat16, "reduce_dtype": reduce}
    return mapped


def _with_checkpointing(plugin: ZeroPPPlugin, offload: bool) -> ZeroPPPlugin:
    """`plugin` recomputing every block, unless it already recomputes some ('except_last'), and
    with `offload` (activation_checkpointing_kwargs={"offload": True}, the saved activations in
    host memory) offloading every stage's (`offload_activations=True`, docs/offload.md), unless
    it already says where."""
    config = plugin.run_settings().config
    change: dict[str, Any] = {}
    if config.activation_checkpointing in (False, "none", None):
        change["activation_checkpointing"] = True
    if offload and config.offload_activations in (False, "off"):
        change["offload_activations"] = True
    if not change:
        return plugin
    mapped = copy.copy(plugin)
    if plugin.config is not None:
        mapped.config = dataclasses.replace(plugin.config, **change)
    else:
        mapped.settings = {**plugin.settings, **change}
    return mapped


def accelerator_arguments(args: Any, build: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """The keyword arguments the Trainer gives its `Accelerator` (`create_accelerator_and_
    postprocess`, `build` its `_build_accelerator_args`), for a `ZeroPPAccelerator`: the
    Trainer accumulates itself (one step per call), no DeepSpeed or dynamo plugin (refused), and
    no autocast (`bf16=True` is the plugin's `param_dtype`: the stages are not prepared models)."""
    config = args.accelerator_config
    grad_acc = dict(config.gradient_accumulation_kwargs or {})
    if "num_steps" in grad_acc:
        if args.gradient_accumulation_steps > 1:
            raise ValueError(
                "AcceleratorConfig's gradient_accumulation_kwargs['num_steps'] and "
                "TrainingArguments(gradient_accumulation_steps>1) are both set; keep one."
            )
        args.gradient_accumulation_steps = grad_acc["num_steps"]  # as the Trainer does
    grad_acc["num_steps"] = 1
    settings = config.to_dict()
    loaders = DataLoaderConfiguration(**{k: settings[k] for k in _LOADER_SETTINGS})
    loaders.data_seed = args.data_seed
    loaders.non_blocking = settings["non_blocking"]
    kwargs = build(
        dataloader_config=loaders,
        gradient_accumulation_plugin=GradientAccumulationPlugin(**grad_acc),
    )
    kwargs.update(mixed_precision="no", deepspeed_plugin=None)
    kwargs.pop("dynamo_plugin", None)
    return kwargs
