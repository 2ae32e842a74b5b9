"""The planner prices context parallelism (`plan.context`): one CP rank's activations, FLOPs,
model state and K/V traffic, cp in the search space, and a CP layout chosen only where it fits
or wins."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.models import GPT, GPTConfig
from lightning_zeropp.plan import Hardware, predict_comm, predict_memory, predict_step_time
from lightning_zeropp.plan.context import kv_bytes, rank_profile
from lightning_zeropp.plan.loss_memory import last_stage_transients
from lightning_zeropp.plan.peaks import rank_memory
from lightning_zeropp.plan.profile import profile_model
from lightning_zeropp.plan.search import context_sizes, enumerate_layouts, search

SEQ, DIM, LAYERS = 1024, 64, 4


def _model(seq: int = SEQ, dim: int = DIM, layers: int = LAYERS) -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=128, seq_len=seq, dim=dim, num_heads=2, num_layers=layers))


def _hardware(memory: int | None = None) -> Hardware:
    return Hardware(
        flops_per_s=1e11, intra_node_Bps=1e9, inter_node_Bps=1e8, node_size=4,
        latency_s=1e-5, memory_Bps=1e10, memory_bytes=memory,
    )  # fmt: skip


@pytest.mark.parametrize("cp", [2, 4])
def test_a_cp_rank_saves_its_part_of_the_sequence_plus_the_gathered_keys_values_and_a_mask(cp):
    model = _model()
    whole, mine = profile_model(model, 1, SEQ, None), rank_profile(model, 1, SEQ, None, cp)
    local = profile_model(model, 1, SEQ // cp, None)  # the model at its part of the sequence
    # outside the blocks (embeddings, head, loss) every tensor is per token (a scalar aside)
    assert mine.before.saved * cp == whole.before.saved
    assert mine.after.saved * cp == pytest.approx(whole.after.saved, abs=4 * cp)
    # a block: its part, plus K and V of the whole sequence (fp32); the first block also the
    # (SEQ/cp x SEQ) mask, which the later blocks share (one per micro-batch, not per layer)
    kv, mask = 2 * SEQ * DIM * 4, (SEQ // cp) * SEQ * 4
    for i, (block, part) in enumerate(zip(mine.blocks, local.blocks, strict=True)):
        assert block.saved == part.saved + kv + (mask if i == 0 else 0)
    # and 1/cp of the FLOPs (the load balance gives each rank as many query-key pairs)
    assert sum(b.flops for b in mine.blocks) * cp == pytest.approx(
        sum(b.flops for b in whole.blocks), rel=1e-12
    )


@pytest.mark.parametrize("cp", [2, 4])
def test_on_the_cpu_a_cp_rank_saves_its_part_of_the_sequence_only(cp):
    # attention by blocks (the runtime's CPU path, `core.step.context_blocks`): no gathered K/V
    # and no mask kept, so every block saves what the model saves at SEQ/cp tokens; FLOPs as
    # the masked path's (this rank's queries against all keys)
    model = _model()
    masked = rank_profile(model, 1, SEQ, None, cp)
    mine = rank_profile(model, 1, SEQ, None, cp, device_type="cpu")
    local = profile_model(model, 1, SEQ // cp, None)
    assert [b.saved for b in mine.blocks] == [b.saved for b in local.blocks]
    assert [b.flops for b in mine.blocks] == [b.flops for b in masked.blocks]
    assert mine.after.saved == masked.after.saved


def test_activations_halve_with_cp_2_but_for_the_gathered_keys_values_and_the_mask():
    seq, dim, layers = 512, 256, 2
    model = _model(seq=seq, dim=dim, layers=layers)
    config = {"pp_size": 1, "num_microbatches": 1, "node_size": 2}
    configs = [ZeroPPConfig(dp_shard_size=2, **config), ZeroPPConfig(cp_size=2, **config)]
    one, two = (rank_memory(model, c, 2, 2 // c.cp_size, seq)[0] for c in configs)
    attention = layers * 2 * seq * dim * 4 + (seq // 2) * seq * 4  # K, V whole; one mask
    # the head and the loss run on whole sequences on every CP rank (the front gathers them):
    # what they hold while they run is the same at cp 1 and cp 2
    loss = max(last_stage_transients(model, configs[0].resolve(2), 1, seq))
    assert loss > 0
    assert two["activations"] - attention - loss == pytest.approx(
        (one["activations"] - loss) / 2, rel=1e-3
    )
    assert two["activations"] < 0.75 * one["activations"]
    assert two["model_state"] == one["model_state"]  # sharded over dp_shard x cp alike


def test_model_state_is_sharded_over_dp_shard_times_cp():
    model = _model()
    plain = predict_memory(model, ZeroPPConfig(pp_size=2, dp_shard_size=4, node_size=8), 8)
    cp = predict_memory(model, ZeroPPConfig(pp_size=2, dp_shard_size=2, cp_size=2, node_size=8), 8)
    assert [m.model_state for m in cp] == [m.model_state for m in plain]
    assert [m.rank for m in cp] == list(range(8))


@pytest.mark.parametrize("cp", [2, 4])
def test_kv_traffic_is_each_ranks_keys_and_values_per_block_and_micro_batch(cp):
    model, rows, m = _model(), 2, 2
    local_kv = 2 * rows * (SEQ // cp) * DIM * 4  # K and V: all heads x head_dim, fp32
    assert kv_bytes(model, SEQ, None, cp) * rows == local_kv
    config = ZeroPPConfig(pp_size=1, dp_shard_size=4 // cp, cp_size=cp, num_microbatches=m)
    summary = predict_comm(model, config, 4, rows * m * (4 // cp), SEQ)[0]
    gathers, reduces = summary["all_gather"]["cp"], summary["reduce_scatter"]["cp"]
    assert gathers == {"count": 2 * LAYERS * m, "bytes": LAYERS * m * local_kv}
    # reduce-scatter: the whole gathered gradient is the input (CommCounter's convention)
    assert reduces == {"count": 2 * LAYERS * m, "bytes": LAYERS * m * local_kv * cp}
    # on the wire: (cp - 1) ring hops of this rank's share each way, added to each block
    hw = _hardware()
    plain = predict_step_time(model, config, 4, rows * m * (4 // cp), SEQ, hw)
    free = predict_step_time(
        model, config, 4, rows * m * (4 // cp), SEQ,
        dataclasses.replace(hw, intra_node_Bps=1e30, latency_s=0.0),
    )  # fmt: skip
    per_block = (cp - 1) * (2 * hw.latency_s + local_kv / hw.intra_node_Bps)
    assert plain.ranks[0].compute - free.ranks[0].compute == pytest.approx(
        2 * per_block * LAYERS * m, rel=0.05
    )


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize(("cp", "dtype"), [(2, None), (4, None), (2, torch.bfloat16)])
def test_on_the_cpu_the_blocks_traffic_is_priced(cp, dtype, recompute):
    # the runtime's CPU path (`core.step.context_blocks`), per block and micro-batch: K and V
    # stacked in one all-gather in the forward (again where the block recomputes), one more
    # in the backward (nothing gathered is kept), and one reduce-scatter of their stacked
    # gradients, summed in fp32 for a bf16 run
    model, rows, m = _model(), 2, 2
    size = 2 if dtype is torch.bfloat16 else 4
    local_kv = 2 * rows * (SEQ // cp) * DIM * size  # this rank's K and V
    summed = 2 * rows * SEQ * DIM * 4  # the whole stacked gradient, fp32 (the scatter's input)
    config = ZeroPPConfig(
        pp_size=1, dp_shard_size=1, cp_size=cp, num_microbatches=m, param_dtype=dtype,
        activation_checkpointing=recompute,
    )  # fmt: skip
    forwards = LAYERS * m * (2 if recompute else 1)
    summary = predict_comm(model, config, cp, rows * m, SEQ, device_type="cpu")[0]
    assert summary["all_gather"]["cp"] == {
        "count": forwards + LAYERS * m,
        "bytes": (forwards + LAYERS * m) * local_kv,
    }
    assert summary["reduce_scatter"]["cp"] == {"count": LAYERS * m, "bytes": LAYERS * m * summed}
    # on a GPU the masked path's: K and V apart, kept for the backward, reduced in their dtype
    gpu = predict_comm(model, config, cp, rows * m, SEQ)[0]
    assert gpu["all_gather"]["cp"] == {"count": 2 * forwards, "bytes": forwards * local_kv}
    assert gpu["reduce_scatter"]["cp"] == {
        "count": 2 * LAYERS * m,
        "bytes": LAYERS * m * local_kv * cp,
    }
    # the step time, on a CPU machine (no overlap): (cp - 1) ring hops of this rank's share per
    # call, the forward's gather, the backward's gather and reduce-scatter (fp32: 4 / size)
    hw = dataclasses.replace(_hardware(), overlap=False)
    free = dataclasses.replace(hw, intra_node_Bps=1e30, latency_s=0.0)
    plain = predict_step_time(model, config, cp, rows * m, SEQ, hw)
    none = predict_step_time(model, config, cp, rows * m, SEQ, free)
    hop = local_kv / hw.intra_node_Bps
    forward = (cp - 1) * (hw.latency_s + hop)
    backward = (cp - 1) * (2 * hw.latency_s + hop + hop * 4 / size)
    per_block = forward * (2 if recompute else 1) + backward
    assert plain.ranks[0].compute - none.ranks[0].compute == pytest.approx(
        per_block * LAYERS * m, rel=0.05
    )


def test_the_search_tries_cp_inside_a_node_that_splits_the_sequence():
    assert context_sizes(8, 4, 1024) == [1, 2, 4]
    assert context_sizes(8, 4, 12) == [1, 2]  # 12 tokens do not split into 8 chunks
    layouts = list(enumerate_layouts(8, 8, 16, 4, seq_len=1024))
    sizes = {
        (s["pp_size"], s["dp_replicate_size"], s["dp_shard_size"], s.get("cp_size", 1))
        for s in layouts
    }
    assert all(pp * rep * shard * cp == 8 for pp, rep, shard, cp in sizes)
    assert {cp for *_, cp in sizes} == {1, 2, 4}
    # a shard group (dp_shard x cp) spanning nodes only as the whole of dp
    assert all(shard * cp <= 4 or rep == 1 for _, rep, shard, cp in sizes)
    assert {s.get("cp_size", 1) for s in enumerate_layouts(8, 8, 16, 4)} == {1}  # no seq_len


def _layout(pp: int, shard: int, cp: int, m: int = 1) -> dict:
    return {"pp_size": pp, "dp_shard_size": shard, "num_microbatches": m, "node_size": 4,
            **({"cp_size": cp} if cp > 1 else {})}  # fmt: skip


def test_a_cp_layout_is_chosen_only_where_it_fits_or_wins():
    model, world, seq = _model(seq=1024, dim=256, layers=4), 4, 1024
    # four rows on four ranks: data parallelism splits the work as well as cp does, without
    # the K/V traffic and the gathered K/V held: cp 1 wins, and needs the least memory
    layouts = [_layout(1, 4 // cp, cp) for cp in (1, 2, 4)]
    need = [
        max(r["total"] for r in rank_memory(model, ZeroPPConfig(**s), world, 4, seq))
        for s in layouts
    ]
    assert need[0] < min(need[1:])
    (best,) = search(model, world, 4, seq, _hardware(), layouts=layouts, top=1)
    assert "cp_size" not in best.settings
    # two rows on four ranks: no layout without cp uses every rank (a pipeline needs as many
    # micro-batches as stages); the search offers only CP layouts, and cp 2 (less traffic)
    # wins unless only cp 4 in two micro-batches (a quarter of a row at once) fits
    space = list(enumerate_layouts(world, 4, 2, 4, seq_len=seq))
    assert space and all(s.get("cp_size", 1) > 1 for s in space)
    layouts = [_layout(1, 2, 2), _layout(1, 1, 4, m=2)]
    need = [
        max(r["total"] for r in rank_memory(model, ZeroPPConfig(**s), world, 2, seq))
        for s in layouts
    ]
    assert need[1] < need[0]
    (best,) = search(model, world, 2, seq, _hardware(), layouts=layouts, top=1)
    assert best.settings["cp_size"] == 2
    (best,) = search(model, world, 2, seq, _hardware(sum(need) // 2), layouts=layouts, top=1)
    assert best.settings["cp_size"] == 4 and best.memory_bytes <= sum(need) // 2


def test_a_sequence_that_does_not_split_into_2_cp_chunks_is_refused():
    with pytest.raises(ValueError, match="seq_len=12 does not split into 2 x cp_size = 8"):
        rank_profile(_model(), 1, 12, None, 4)
