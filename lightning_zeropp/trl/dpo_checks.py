"""What `ZeroPPDPOTrainer` refuses at construction, on every rank, from its arguments alone:
what the pipelined DPO loss does not compute (yet), each with the fix."""

from __future__ import annotations

from typing import Any

from lightning_zeropp.trl.adapters import peft_refusals

__all__ = ["NO_PREDICT", "extra_reference_weights", "refusals"]

NO_PREDICT = (
    "ZeroPPDPOTrainer: predict() is not supported: TRL's DPOTrainer.predict reads the model "
    "output's logits, which its fused LM head does not produce (TRL's own fails on them). Use "
    "evaluate() for the loss and TRL's metrics."
)


def refusals(args: Any, init: dict[str, Any]) -> list[str]:
    """What the pipelined DPO loss does not compute (yet), from the arguments alone."""
    found = []
    if args is not None and args.sync_ref_model:
        found.append(
            "sync_ref_model=True (the reference moved towards the policy during training) is "
            "not pipelined. Set sync_ref_model=False."
        )
    found += peft_refusals(init)  # a LoRA policy: only what the adapters-off reference covers
    if args is None:
        return found
    if list(args.loss_type) != ["sigmoid"]:
        found.append(f"loss_type={args.loss_type!r} is not pipelined; use loss_type='sigmoid'.")
    if args.ld_alpha is not None:
        found.append(f"ld_alpha={args.ld_alpha!r} is not pipelined; set ld_alpha=None.")
    if args.f_divergence_type != "reverse_kl":
        found.append(
            f"f_divergence_type={args.f_divergence_type!r} is not pipelined; use 'reverse_kl'."
        )
    if args.use_weighting:
        found.append("use_weighting=True (WPO) is not pipelined; set use_weighting=False.")
    if args.activation_offloading:
        found.append(
            "activation_offloading=True would hook the whole model's saved tensors, not the "
            "pipeline's stages. Set activation_offloading=False."
        )
    return found


def extra_reference_weights(reference: Any, policy: Any) -> str | None:
    """The reference's weights the policy has no place for (a deeper `ref_model`), or None.
    The stages check the policy's names only (`reference.FrozenReference`), so extra layers would
    be dropped without a word; every rank holds both whole models here, so all refuse alike."""
    extra = sorted(set(reference) - set(policy))
    if not extra:
        return None
    return (
        f"ZeroPPDPOTrainer: the reference model has {len(extra)} weights the policy has not "
        f"({', '.join(repr(name) for name in extra[:3])}{', ...' if len(extra) > 3 else ''}): "
        "a deeper or wider ref_model than the policy. Pass a ref_model of the policy's "
        "architecture (or ref_model=None: the policy's initial weights)."
    )
