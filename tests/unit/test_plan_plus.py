"""ZeRO++ in the planner: what qwZ, hpZ and qgZ move and hold, and what that does to a step
(their traffic is checked against counted runs in tests/distributed/test_planner.py)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.models import GPT, GPTConfig
from lightning_zeropp.plan import Hardware, predict_step_time
from lightning_zeropp.plan.peaks import rank_memory
from lightning_zeropp.plan.plus import plus_memory, unit_traffic
from lightning_zeropp.plan.programs import programs_for

SHAPES = [(96, 32), (96,), (32, 32)]  # a unit: two matrices and a bias


def _cfg(**plus) -> ZeroPPConfig:
    return ZeroPPConfig(dp_shard_size=8, node_size=4, param_dtype="bf16", **plus).resolve(8)


def test_each_technique_moves_what_its_comm_packs() -> None:
    plain = unit_traffic(_cfg(), SHAPES)
    assert plain.gather == (12 * 32 + 12 + 4 * 32) * 2  # bf16 shards of 8
    assert plain.reduce == 8 * (12 * 32 + 12 + 4 * 32) * 4  # fp32, the whole input
    q = unit_traffic(_cfg(quantized_weights="int8", quant_block_size=64), SHAPES)
    # matrices: one byte an element and a 4-byte scale per 64; the bias raw (bf16)
    assert q.gather == 384 + 4 * 6 + 12 * 2 + 128 + 4 * 2
    g = unit_traffic(_cfg(quantized_gradients="int4", quant_block_size=64), SHAPES)
    row = 192 + 4 * 6 + 12 * 4 + 64 + 4 * 2  # half a byte an element; the bias raw fp32
    assert (g.reduce, g.intra, g.cross) == (0, 8 * row, 2 * row)
    h = unit_traffic(_cfg(hpz_partition_size=4), SHAPES)
    assert h.node_gather == (24 * 32 + 24 + 8 * 32) * 2


def test_hpz_holds_its_copy_and_int4_its_error_rows() -> None:
    units = [SHAPES, SHAPES]
    width = 12 * 32 + 12 + 4 * 32
    copy = plus_memory(_cfg(hpz_partition_size=4), units)
    assert copy == 2 * (24 * 32 + 24 + 8 * 32) * 2  # a quarter of each unit, bf16
    feedback = plus_memory(_cfg(quantized_gradients="int4"), units)
    buffers = unit_traffic(_cfg(quantized_gradients="int4"), SHAPES).buffers
    assert feedback == 2 * 4 * width * (8 + 2) + buffers  # k rows in node, 2 across, fp32


def test_zeropp_plus_speeds_a_step_over_a_slow_link_and_costs_memory() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=128, seq_len=64, dim=128, num_heads=4, num_layers=4))
    hw = Hardware(flops_per_s=1e12, intra_node_Bps=1e10, inter_node_Bps=1e8, node_size=4,
                  latency_s=1e-6, memory_Bps=1e12, dtype="bf16")  # fmt: skip
    base = {"dp_shard_size": 8, "node_size": 4, "num_microbatches": 2, "param_dtype": "bf16"}
    plus = {"quantized_weights": "int8", "quantized_gradients": "int4", "hpz_partition_size": 4}
    plain = predict_step_time(model, ZeroPPConfig(**base), 8, 16, 64, hw)
    fast = predict_step_time(model, ZeroPPConfig(**base, **plus), 8, 16, 64, hw)
    assert fast.step_s < plain.step_s / 2
    # hpZ: every backward gathers the in-node copy, the forwards the whole group
    ops = programs_for(ZeroPPConfig(**base, **plus).resolve(8))[0]
    assert all(op.from_node == (op.kind == "B") for op in ops if op.gather)
    memory = rank_memory(model, ZeroPPConfig(**base, **plus), 8, 16, 64)
    assert all(r["zeropp_plus"] > 0 for r in memory)
    assert all(r["zeropp_plus"] == 0 for r in rank_memory(model, ZeroPPConfig(**base), 8, 16, 64))
    assert math.isfinite(fast.step_s)


@pytest.mark.parametrize("mode", ["fp", "bf16", "int8"])
def test_weight_modes_order_their_volume(mode: str) -> None:
    moved = unit_traffic(_cfg(quantized_weights=mode), SHAPES).gather
    assert moved <= unit_traffic(_cfg(), SHAPES).gather
