"""The planner's activations per pipeline rank: offload and recompute priced where they run, and
chosen for the ranks over the memory only (`plan.activations`, `plan.steptime`, `plan.per_rank`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.models import GPT, GPTConfig
from lightning_zeropp.plan import Hardware
from lightning_zeropp.plan.activations import activation_peaks, host_activation_peaks
from lightning_zeropp.plan.peaks import rank_memory
from lightning_zeropp.plan.per_rank import per_rank_variants
from lightning_zeropp.plan.search import search
from lightning_zeropp.plan.steptime import predict_step_time

WORLD, BATCH, SEQ = 4, 16, 64
LAYOUT = {"pp_size": 4, "num_microbatches": 8, "split_points": [2, 4, 6]}


def _model() -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=512, seq_len=SEQ, dim=64, num_heads=2, num_layers=8))


def _hardware(memory: int | None = None, host: float | None = 1e9) -> Hardware:
    return Hardware(
        flops_per_s=1e11, intra_node_Bps=1e9, inter_node_Bps=1e8, node_size=4, latency_s=1e-5,
        memory_Bps=1e10, memory_bytes=memory, host_Bps=host,
    )  # fmt: skip


def test_offloading_ranks_hold_one_micro_batch_on_the_device():
    model = _model()
    off = activation_peaks(model, ZeroPPConfig(**LAYOUT), WORLD, BATCH, SEQ)
    auto = ZeroPPConfig(**LAYOUT, offload_activations="auto")
    on = activation_peaks(model, auto, WORLD, BATCH, SEQ)
    host = host_activation_peaks(model, auto, WORLD, BATCH, SEQ)
    assert off[0] > off[1] > off[2] > off[3]  # 1F1B: 4, 3, 2, 1 micro-batches in flight
    assert (on[2], on[3]) == (off[2], off[3]) and host[2] == host[3] == 0
    for rank in (0, 1):  # one micro-batch's bytes, copied back for its backward
        assert on[rank] == off[rank] // (4 - rank)
        assert host[rank] == off[rank]


def test_recompute_ranks_recompute_there_only():
    model = _model()
    none = activation_peaks(model, ZeroPPConfig(**LAYOUT), WORLD, BATCH, SEQ)
    everywhere = activation_peaks(
        model, ZeroPPConfig(**LAYOUT, activation_checkpointing=True), WORLD, BATCH, SEQ
    )
    first = ZeroPPConfig(**LAYOUT, activation_checkpointing=True, recompute_ranks=[0])
    got = activation_peaks(model, first, WORLD, BATCH, SEQ)
    assert got[0] == everywhere[0] < none[0] and [got[r] for r in (1, 2, 3)] == [
        none[r] for r in (1, 2, 3)
    ]
    slow = predict_step_time(model, first, WORLD, BATCH, SEQ, _hardware()).step_s
    assert (
        predict_step_time(model, ZeroPPConfig(**LAYOUT), WORLD, BATCH, SEQ, _hardware()).step_s
        < slow
    )


def test_offload_is_priced_over_the_host_link_and_refused_without_one():
    model, auto = _model(), ZeroPPConfig(**LAYOUT, offload_activations="auto")
    plain = predict_step_time(model, ZeroPPConfig(**LAYOUT), WORLD, BATCH, SEQ, _hardware())
    fast = predict_step_time(model, auto, WORLD, BATCH, SEQ, _hardware(host=1e15))
    slow = predict_step_time(model, auto, WORLD, BATCH, SEQ, _hardware(host=1e6))
    assert fast.step_s == pytest.approx(plain.step_s, rel=1e-6) and slow.step_s > 2 * plain.step_s
    with pytest.raises(ValueError, match=r"add bandwidth_GBps.host"):
        predict_step_time(model, auto, WORLD, BATCH, SEQ, _hardware(host=None))


def test_the_search_recomputes_or_offloads_on_the_ranks_over_the_memory_only():
    model = _model()
    totals = [r["total"] for r in rank_memory(model, ZeroPPConfig(**LAYOUT), WORLD, BATCH, SEQ)]
    budget = (totals[0] + totals[1]) // 2  # rank 0 over, the others within
    assert totals[0] > budget >= max(totals[1:])
    variants = per_rank_variants(model, LAYOUT, WORLD, BATCH, SEQ, _hardware(budget))
    chosen = [{k: v for k, v in s.items() if k not in LAYOUT} for s, _ in variants]
    assert chosen == [
        {"activation_checkpointing": "all", "recompute_ranks": [0]},
        {"offload_activations": [0]},
    ]
    assert all(memory <= budget for _, memory in variants)
    no_host = dataclasses.replace(_hardware(budget), host_Bps=None)
    assert len(per_rank_variants(model, LAYOUT, WORLD, BATCH, SEQ, no_host)) == 1
    found = search(
        model, WORLD, BATCH, SEQ, _hardware(budget), layouts=[LAYOUT], per_rank=True, top=10
    )
    assert sorted(map(repr, (c.settings for c in found))) == sorted(repr(s) for s, _ in variants)
    assert search(model, WORLD, BATCH, SEQ, _hardware(budget), layouts=[LAYOUT]) == []


def test_a_prefetched_copy_back_costs_only_what_the_backward_cannot_hide():
    from lightning_zeropp.plan.stage_costs import _offloaded, _prefetch_wait

    # the last unit's share always waits; the rest hides behind the backward's compute
    assert _prefetch_wait(1.0, [10.0] * 4) == pytest.approx(0.25)
    # a copy longer than the compute: the backward ends when the last share arrives, plus the
    # first unit's compute
    assert _prefetch_wait(8.0, [1.0] * 4) == pytest.approx(8.0 + 1.0 - 4.0)
    units = [(1.0, 2.0)] * 4
    one_task = ZeroPPConfig(**LAYOUT, offload_activations=True).resolve(WORLD)
    split = ZeroPPConfig(**{**LAYOUT, "schedule": "zbv", "split_points": None},
                         offload_activations=True).resolve(WORLD)  # fmt: skip
    hardware = _hardware(host=1.0)
    full = [b for _, b in _offloaded(units, 4, one_task, hardware)]
    assert sum(full) - 8.0 == pytest.approx(1.0)  # 4 s of copy behind 8 s of compute: 1 s waits
    assert sum(b for _, b in _offloaded(units, 4, split, hardware)) - 8.0 == pytest.approx(8.0)
