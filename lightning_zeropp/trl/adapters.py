"""DPO's reference for a LoRA policy (`ZeroPPDPOTrainer` with `peft_config`): the adapters off.

With a PEFT policy and no `ref_model`, TRL 1.16 keeps no reference model: its reference is the
policy called inside `use_adapter(model, None)`, i.e. `PeftModel.disable_adapter()`, every tuner
layer returning its base layer's output, in the step's reference forward and in
`precompute_ref_log_probs`'s pass alike. A vanilla LoRA layer returns
`base(x) + lora_B(lora_A(dropout(x))) * scaling`, so with every `lora_B` (and
`lora_embedding_B`) parameter zero it returns `base(x) + 0`, which is `base(x)` exactly (in any
mode: the dropout's draw is multiplied by zero). The pipeline's reference is therefore a
`reference.FrozenReference` over the `lora_B` parameters only, with a state of zeros: swapped into
the stages for the reference's forward-only pass, as a `ref_model`'s weights are.

That equality holds for vanilla LoRA only, so refused at construction, on every rank (every rank
builds the same model from the same arguments), each with the reason and the fix: other PEFT
methods, LoRA variants (DoRA, aLoRA, ...: their output with `lora_B` zero is not the base
layer's), `modules_to_save` and trainable tokens (trained copies of whole modules, which
`disable_adapter` swaps back), several adapters, a `PeftModel` passed in (TRL then makes a "ref"
adapter, a copy of the policy's, as the reference), and `peft_config` with a `ref_model` (a
reference the stages could only take under the base model's names). Also refused: the base
model's dropout left on (`disable_dropout=False` with a dropout module of p > 0 outside LoRA's, or
a config's `attention_dropout` > 0): TRL's reference runs the policy in training mode, drawing it,
the pipeline's forward-only pass does not. LoRA's own dropout (`lora_dropout`) is not refused:
neither reference reaches it, and the policy's draws differ under a pipeline as any dropout's do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["adapters_off", "is_peft", "peft_refusals", "wrapped_refusal"]

# The parameters whose zero turns a vanilla LoRA layer into its base layer (Linear, Conv and
# MultiheadAttention layers hold `lora_B`; Embedding layers `lora_embedding_B`)
_B_KEYS = (".lora_B.", ".lora_embedding_B.")
_FIX = "Use TRL's DPOTrainer, or a plain LoraConfig (peft_config=LoraConfig(r=..., ...))."


def is_peft(model: Any) -> bool:
    """A PEFT model (one with `get_base_model`, as `mode.drop_fused_head` tells it)."""
    return callable(getattr(model, "get_base_model", None))


def peft_refusals(init: dict[str, Any]) -> list[str]:
    """What of a PEFT policy the pipeline does not reproduce, from the arguments alone."""
    config, model = init.get("peft_config"), init.get("model")
    found = []
    if config is None and is_peft(model):
        why = (
            "with a ref_model is not pipelined (the stages hold the PeftModel's weights, under "
            "other names than the ref_model's). "
            if init.get("ref_model") is not None
            else "is not pipelined: TRL then adds a 'ref' adapter (a copy of the policy's) as "
            "the reference. "
        )
        found.append(
            f"a PeftModel passed as the model {why}Pass the base model with "
            "peft_config=LoraConfig(...) and ref_model=None (the reference is then the adapters "
            "disabled), or merge the adapter first (model.merge_and_unload())."
        )
    if config is None:
        return found
    if init.get("ref_model") is not None:
        found.append(
            "peft_config with a ref_model is not pipelined (the stages hold the PeftModel's "
            "weights, under other names than the ref_model's). Pass ref_model=None: TRL's "
            "reference is then the policy with its adapters disabled, its base model."
        )
    if str(getattr(config, "peft_type", "")) not in ("LORA", "PeftType.LORA"):
        found.append(
            f"peft_config={type(config).__name__} is not pipelined: the reference (the adapters "
            "disabled) is reproduced for LoRA only. Use peft_config=LoraConfig(...)."
        )
        return found
    if getattr(config, "use_dora", False):
        found.append(
            "use_dora=True is not pipelined: a DoRA layer's output with lora_B zero is not its "
            "base layer's, which TRL's reference (the adapters disabled) is. Set use_dora=False."
        )
    if getattr(config, "modules_to_save", None):
        found.append(
            f"modules_to_save={config.modules_to_save!r} is not pipelined: TRL's reference "
            "swaps the trained copies of those modules back to the originals. Remove "
            "modules_to_save (train adapters only)."
        )
    if getattr(config, "trainable_token_indices", None):
        found.append(
            "trainable_token_indices is not pipelined: TRL's reference swaps the trained "
            "tokens back to the originals. Set trainable_token_indices=None."
        )
    return found


def wrapped_refusal(model: Any, disable_dropout: bool) -> str | None:
    """What of the PeftModel TRL built the pipeline does not reproduce, or None (also for a
    model that is not PEFT): several adapters, trained module copies, LoRA variants, the base
    model's dropout on."""
    if not is_peft(model):
        return None
    from peft.tuners.lora import LoraLayer

    adapters = sorted(getattr(model, "peft_config", {}))
    if len(adapters) != 1:
        return f"a PEFT model with adapters {adapters} is not pipelined: one adapter only."
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in ("ModulesToSaveWrapper", "TrainableTokensWrapper"):
            return (
                f"{name!r} is a {kind} (a trained copy of a module, swapped back for TRL's "
                "reference), which is not pipelined. Train adapters only (no modules_to_save, "
                "trainable_token_indices)."
            )
        if isinstance(module, LoraLayer) and module.lora_variant:
            variants = sorted(type(v).__name__ for v in module.lora_variant.values())
            return (
                f"{name!r} is a LoRA variant ({', '.join(variants)}): its output with lora_B "
                "zero is not its base layer's, which TRL's reference (the adapters disabled) "
                f"is, so it is not pipelined. {_FIX}"
            )
    # TRL's reference is the policy in its mode, training: the base model's dropout draws there
    # (LoRA's own is skipped with the adapters), the pipeline's forward-only reference draws none
    rate = getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0
    if rate > 0:  # functional in the attention, on in training whatever disable_dropout says
        return (
            f"attention_dropout={rate} in the model's config with a PEFT model: TRL's reference "
            "(the policy with its adapters disabled, in training mode) draws it, the pipeline's "
            "forward-only reference pass does not. Set the config's attention_dropout=0.0."
        )
    if not disable_dropout:
        found = next(
            (
                name
                for name, module in model.named_modules()
                if isinstance(module, nn.Dropout) and module.p > 0 and "lora_dropout" not in name
            ),
            None,
        )
        if found is not None:
            return (
                f"disable_dropout=False with dropout in {found!r} and a PEFT model: TRL's "
                "reference (the policy with its adapters disabled, in training mode) draws it, "
                "the pipeline's forward-only reference pass does not. Set disable_dropout=True "
                "(DPOConfig's default)."
            )
    return None


def adapters_off(
    params: list[tuple[str, nn.Parameter]],
) -> tuple[list[tuple[str, nn.Parameter]], dict[str, torch.Tensor]]:
    """The pipeline's `lora_B` parameters and a state of zeros for them (full shapes: a
    `FrozenReference` cuts it as each parameter is placed): the adapters disabled."""
    chosen = [(name, p) for name, p in params if any(key in f".{name}" for key in _B_KEYS)]
    zeros = {name: torch.zeros(p.shape, dtype=p.dtype) for name, p in chosen}
    return chosen, zeros
