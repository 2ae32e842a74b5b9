"""What the planner's command line (`python -m lightning_zeropp.plan`) prints about a priced
layout: its settings in words (`describe`), its predicted step under the other cut of stages
(`other_cut`), and its last stage's activation peak, with the head and the loss in chunks or
whole (`last_stage`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["GiB", "describe", "last_stage", "other_cut"]

GiB = 2**30


def other_cut(
    model: Any,
    settings: dict[str, Any],
    world: int,
    own: dict[str, Any],
    seq_len: int,
    hardware: Any,
    cut: str,
) -> str:
    """The layout's predicted step under the other cut, and its change against this one."""
    from lightning_zeropp.core.settings.config import ZeroPPConfig
    from lightning_zeropp.plan.cut import with_cut
    from lightning_zeropp.plan.steptime import predict_step_time

    if settings["pp_size"] == 1:
        return "-"
    priced = [
        predict_step_time(
            model, ZeroPPConfig(**s), world, own["global_batch"], seq_len, hardware,
            optimizer=own["optimizer"],
        ).step_s
        for s in (settings, with_cut(model, {**settings, "split_points": None}, seq_len, cut, world))
    ]  # fmt: skip
    return f"{priced[1]:.3f} ({priced[1] / priced[0] - 1:+.0%})"


def last_stage(model: Any, settings: dict[str, Any], world: int, batch: int, seq: int) -> str:
    """The best layout's last stage: its rank's activation peak, whether the head and the loss
    are priced in chunks, and the peak with whole logits beside it."""
    import dataclasses

    from lightning_zeropp.core.settings.config import ZeroPPConfig
    from lightning_zeropp.core.settings.placement import rank_of_stage, schedule_style
    from lightning_zeropp.plan.activations import activation_peaks
    from lightning_zeropp.plan.loss_chunk import priced_chunk
    from lightning_zeropp.plan.profile import micro_batch_rows

    config = ZeroPPConfig(**settings)
    cfg = config.resolve(world)
    rank = rank_of_stage(schedule_style(cfg.schedule), cfg.num_stages - 1, cfg.pp_size)
    chunk = priced_chunk(
        model, cfg, micro_batch_rows(batch, cfg.dp_size, cfg.num_microbatches), seq
    )
    peak = _amount(activation_peaks(model, config, world, batch, seq)[rank])
    if not chunk:
        return f"#1's last stage (pp rank {rank}): {peak} of activations, whole logits"
    whole = activation_peaks(model, dataclasses.replace(config, loss_chunk=0), world, batch, seq)
    return (
        f"#1's last stage (pp rank {rank}): {peak} of activations, the head and the loss in "
        f"chunks of {chunk} tokens (whole logits: {_amount(whole[rank])})"
    )


def _amount(size: int) -> str:
    return f"{size / GiB:.2f} GiB" if size >= GiB else f"{size / 2**20:.2f} MiB"


def describe(settings: dict[str, Any]) -> str:
    s = settings
    text = f"pp {s['pp_size']} x rep {s['dp_replicate_size']} x shard {s['dp_shard_size']}"
    if s.get("cp_size", 1) > 1:
        text += f" x cp {s['cp_size']}"
    if s["pp_size"] > 1:
        text += f", {s['schedule']}"
        if "num_chunks" in s:
            text += f" v={s['num_chunks']}"
        if "unit_size" in s:
            text += f" U={s['unit_size']}"
        if s.get("split_backward") is False:
            text += ", no split backward"
    text += f", {s['num_microbatches']} micro-batches"
    if s.get("split_points"):
        text += f", split at {s['split_points']}"
    if s.get("activation_checkpointing", "none") != "none":
        text += f", recompute {s['activation_checkpointing']}"
        if s.get("recompute_ranks") is not None:
            text += f" on pp ranks {s['recompute_ranks']}"
    if s.get("offload_activations") not in (None, False, "off"):
        text += f", offload activations {s['offload_activations']}"
    return text
