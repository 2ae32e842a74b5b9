"""Published training runs the planner is calibrated on: each run as the planner sees it (model
shape, layout, batch), the throughput its authors measured, and the planner's prediction of it.

Sources (read November 2026; the design notes have the full table):
- torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (Tables 1 and 3): Llama 3.1 8B, FSDP,
  sequence 8192, local batch 2, selective activation checkpointing, H100 at 500 W;
- MosaicML llm-foundry, scripts/train/benchmarking/README.md ("H100 80GB BF16"): MPT-7B and
  MPT-70B, FSDP FULL_SHARD, fused kernels (Triton flash attention) without torch.compile,
  counted with the compiled runs (as the design notes count them);
- NeMo Automodel, docs/performance-summary.mdx and its config
  examples/llm_benchmark/llama3_3/custom_llama3_1_70b_pretrain_benchmark_8nodes.yaml: Llama 3.1
  70B, 64 H100, FSDP2 (dp 32) x context parallel 2, sequence 8192, compiled, Transformer Engine,
  activation checkpointing, resharding after forward;
- Megatron-LM README (images/model_table.png, Megatron-Core r0.8): GPT 7.1B, 96 H100, TP 2, sequence
  4096, 47% MFU.

How each is modelled, and what is approximated (each run's `note`):
- selective activation checkpointing (torchtitan) is priced as none: its recomputation is in the
  efficiency it calibrates;
- MPT's GELU MLP (2 matrices of h x 4h) is priced as a SwiGLU of the same FLOPs (3 of h x 8h/3);
- context parallelism 2 (NeMo) as two ranks each holding half of every sequence, sharded over all
  64 (its extra key/value exchange is not priced);
- Megatron's 7.1B GPT as Llama-2-7B's shape under `plan.megatron` (TP 2), matched on MFU.

`calibrate(run, hardware)` finds the share of peak at which the planner predicts the run's
published figure; a cluster file's efficiency range per mode spans its runs' shares, so each
run's figure falls inside the planner's range for it (tests/unit/test_plan_calibration.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.plan.hardware import Hardware

__all__ = ["PUBLISHED", "PublishedRun", "calibrate", "predict"]

LLAMA31_8B = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
}  # fmt: skip
LLAMA31_70B = {
    "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
}  # fmt: skip
MPT_7B = {
    "hidden_size": 4096, "intermediate_size": 10923, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 50368,
}  # fmt: skip
MPT_70B = {
    "hidden_size": 8192, "intermediate_size": 21845, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 64, "vocab_size": 50368,
}  # fmt: skip
LLAMA2_7B = {
    "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
}  # fmt: skip


@dataclass(frozen=True)
class PublishedRun:
    """One published run: `value` is tokens/s per GPU (or MFU when `metric` is "mfu")."""

    name: str
    source: str
    model: dict[str, int]
    world: int
    seq_len: int  # tokens per row as the planner prices it
    global_batch: int  # rows per step
    compiled: bool
    value: float
    metric: str = "tokens_per_s_per_gpu"
    layout: dict[str, Any] = field(default_factory=dict)  # ZeroPPConfig settings (FSDP runs)
    tp: int = 1  # Megatron runs: tensor parallel size (priced by plan.megatron)
    note: str = ""
    calibrates: bool = True  # False: a check on the planner, not a source of its efficiency


PUBLISHED: tuple[PublishedRun, ...] = (
    PublishedRun(
        "torchtitan Llama 3.1 8B, 8 H100, eager", "torchtitan llama3_h100_202412 Table 1",
        LLAMA31_8B, 8, 8192, 16, False, 5762,
        layout={"dp_shard_size": 8, "num_microbatches": 1},
        note="selective AC priced as none; 500 W H100s",
    ),
    PublishedRun(
        "torchtitan Llama 3.1 8B, 8 H100, compiled", "torchtitan llama3_h100_202412 Table 1",
        LLAMA31_8B, 8, 8192, 16, True, 6667,
        layout={"dp_shard_size": 8, "num_microbatches": 1},
        note="selective AC priced as none; 500 W H100s",
    ),
    PublishedRun(
        "torchtitan Llama 3.1 8B, 128 H100, eager", "torchtitan llama3_h100_202412 Table 3",
        LLAMA31_8B, 128, 8192, 256, False, 5605,
        layout={"dp_shard_size": 128, "num_microbatches": 1},
        note="selective AC priced as none; 500 W H100s",
    ),
    PublishedRun(
        "torchtitan Llama 3.1 8B, 128 H100, compiled", "torchtitan llama3_h100_202412 Table 3",
        LLAMA31_8B, 128, 8192, 256, True, 6514,
        layout={"dp_shard_size": 128, "num_microbatches": 1},
        note="selective AC priced as none; 500 W H100s",
    ),
    PublishedRun(
        "MosaicML MPT-7B, 8 H100, seq 2048", "llm-foundry benchmarking README, H100 BF16",
        MPT_7B, 8, 2048, 48, True, 10643,
        layout={"dp_shard_size": 8, "num_microbatches": 1},
        note="GELU MLP as SwiGLU of equal FLOPs; fused kernels (Triton flash attention), counted as compiled",
    ),
    PublishedRun(
        "MosaicML MPT-7B, 8 H100, seq 4096, AC", "llm-foundry benchmarking README, H100 BF16",
        MPT_7B, 8, 4096, 256, True, 8611,
        layout={"dp_shard_size": 8, "num_microbatches": 2, "activation_checkpointing": "all"},
        note="GELU MLP as SwiGLU of equal FLOPs; fused kernels (Triton flash attention), counted as compiled",
    ),
    PublishedRun(
        "MosaicML MPT-70B, 64 H100, seq 2048, AC", "llm-foundry benchmarking README, H100 BF16",
        MPT_70B, 64, 2048, 2048, True, 1039,
        layout={"dp_shard_size": 64, "num_microbatches": 4, "activation_checkpointing": "all"},
        note="GELU MLP as SwiGLU of equal FLOPs; fused kernels (Triton flash attention), counted as compiled",
    ),
    PublishedRun(
        "NeMo Automodel Llama 3.1 70B, 64 H100, FSDP2 x CP2", "NeMo Automodel performance "
        "summary (pre-training, DGX-H100 BF16)",
        LLAMA31_70B, 64, 4096, 256, True, 866.77,
        layout={"dp_shard_size": 64, "num_microbatches": 4, "activation_checkpointing": "all",
                "reshard_after_forward": True},
        note="CP 2 priced as half-sequences of 4096 on each of 64 ranks (KV exchange unpriced)",
    ),
    PublishedRun(
        "Megatron-Core GPT 7.1B, 96 H100, TP 2", "Megatron-LM README model table (r0.8)",
        LLAMA2_7B, 96, 4096, 192, True, 0.47, metric="mfu", tp=2,
        note="shape assumed Llama-2-7B's; TP's collectives priced unoverlapped (plan.megatron)",
        calibrates=False,
    ),
)  # fmt: skip


@functools.lru_cache(maxsize=8)
def _model(shape: tuple[tuple[str, int], ...]) -> nn.Module:
    from lightning_zeropp.models.hf import build_causal_lm

    with torch.device("meta"):
        return build_causal_lm("llama", max_position_embeddings=8192, **dict[str, Any](shape))


def predict(run: PublishedRun, hardware: Hardware, share: float | None = None) -> float:
    """The planner's figure for `run` (tokens/s per GPU, or MFU) on `hardware`, at `share` of
    its peak (default: `hardware.flops_per_s` as it is)."""
    from lightning_zeropp.plan.megatron import predict_3d
    from lightning_zeropp.plan.steptime import predict_step_time

    hw = hardware
    if share is not None:
        hw = replace(hardware, flops_per_s=(hardware.peak_flops_per_s or 0.0) * share)
    hw = replace(hw, efficiency=None)  # the rate is this one, whatever the mode
    model = _model(tuple(sorted(run.model.items())))
    if run.tp > 1:
        three = predict_3d(model, run.world, run.global_batch, run.seq_len, hw, tp=run.tp,
                           num_microbatches=run.global_batch // (run.world // run.tp))  # fmt: skip
        step_s, mfu = three.step_s, three.mfu
    else:
        config = ZeroPPConfig(param_dtype="bf16", node_size=8, **run.layout)
        plan = predict_step_time(model, config, run.world, run.global_batch, run.seq_len, hw)
        step_s, mfu = plan.step_s, plan.mfu
    if run.metric == "mfu":
        return mfu
    return run.global_batch * run.seq_len / step_s / run.world


def calibrate(run: PublishedRun, hardware: Hardware, tolerance: float = 1e-4) -> float:
    """The share of peak at which the planner predicts `run`'s published figure (bisection:
    the prediction grows with the share)."""
    low, high = 0.05, 1.0
    while high - low > tolerance:
        mid = (low + high) / 2
        low, high = (mid, high) if predict(run, hardware, mid) < run.value else (low, mid)
    return (low + high) / 2
