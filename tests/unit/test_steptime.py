"""The step-time model: the simulator against closed forms of the pipeline bubble, its lanes by
hand, and the programs against the communication counts `plan.comm` predicts."""

from __future__ import annotations

import pytest
import torch

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.settings.placement import rank_of_stage, schedule_style
from lightning_zeropp.models import GPT, GPTConfig
from lightning_zeropp.plan import Hardware, predict_comm, predict_step_time
from lightning_zeropp.plan.activations import task_orders
from lightning_zeropp.plan.memory import stage_units
from lightning_zeropp.plan.programs import programs_for
from lightning_zeropp.plan.simulate import Op, StageCost, simulate


def _uniform(cfg: ZeroPPConfig, f: float, b: float) -> list[StageCost]:
    return [StageCost(forward=(f,), backward=(b,)) for _ in range(cfg.num_stages)]


def _run(cfg: ZeroPPConfig, f: float = 1.0, b: float = 2.0):
    style = schedule_style(cfg.schedule)
    where = {s: rank_of_stage(style, s, cfg.pp_size) for s in range(cfg.num_stages)}
    return simulate(programs_for(cfg), _uniform(cfg, f, b), where, overlap=False)


def _makespan(lines: dict) -> float:
    return max(line.end for line in lines.values())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 4), (4, 8), (3, 7)])
def test_bubble_of_gpipe_and_1f1b_is_the_closed_form(schedule: str, pp: int, m: int) -> None:
    # GPipe (Huang et al.) and 1F1B (Narayanan et al.): every rank idles (pp - 1)(F + B).
    cfg = ZeroPPConfig(pp_size=pp, schedule=schedule, num_microbatches=m).resolve(pp)
    lines = _run(cfg)
    end = max(line.end for line in lines.values())
    assert end == pytest.approx((m + pp - 1) * 3.0)
    for line in lines.values():
        assert line.compute == pytest.approx(3.0 * m)
        assert end - line.compute == pytest.approx((pp - 1) * 3.0)


@pytest.mark.parametrize(("pp", "v", "m"), [(2, 2, 4), (4, 2, 8), (4, 4, 8)])
def test_bubble_of_interleaved_1f1b_shrinks_by_the_chunks(pp: int, v: int, m: int) -> None:
    # Interleaved 1F1B (Narayanan et al. 2021): the bubble is (pp - 1)(F + B) / v, where F and B
    # are a whole rank's share of the model (each of its v chunks costs 1/v of it).
    cfg = ZeroPPConfig(
        pp_size=pp, schedule="interleaved_1f1b", num_chunks=v, num_microbatches=m
    ).resolve(pp)
    lines = _run(cfg, 1.0 / v, 2.0 / v)
    end = max(line.end for line in lines.values())
    assert end == pytest.approx(3.0 * m + (pp - 1) * 3.0 / v)
    assert all(end - line.compute == pytest.approx((pp - 1) * 3.0 / v) for line in lines.values())


def test_zero_bubble_schedules_fill_the_bubble_with_weight_tasks() -> None:
    # ZB-V with F = I = W: (pp - 1)(F + B) / v ... is beaten: less idle than interleaved 1F1B's.
    pp, m = 4, 8
    zbv = ZeroPPConfig(pp_size=pp, schedule="zbv", num_microbatches=m).resolve(pp)
    inter = ZeroPPConfig(pp_size=pp, schedule="interleaved_1f1b", num_microbatches=m).resolve(pp)
    assert _makespan(_run(zbv, 0.5, 1.0)) < _makespan(_run(inter, 0.5, 1.0))


def test_lanes_overlap_a_units_gather_with_the_previous_units_compute() -> None:
    cost = StageCost(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), gather=(0.5,) * 3)
    program = {0: [Op("F", 0, 0, gather=True)]}
    # overlapped: only the first gather shows; serial (gloo): every gather adds
    assert simulate(program, [cost], {0: 0}, overlap=True)[0].end == pytest.approx(3.5)
    assert simulate(program, [cost], {0: 0}, overlap=False)[0].end == pytest.approx(4.5)
    slow = StageCost(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), gather=(2.0,) * 3)
    # gathers longer than compute: the communication lane sets the pace (3 gathers, 1 compute)
    assert simulate({0: [Op("F", 0, 0, gather=True)]}, [slow], {0: 0}, True)[0].end == 7.0
    # a reduce-scatter after a backward: trails the compute on its own lane when overlapped
    red = StageCost(forward=(1.0,), backward=(2.0,), reduce=(1.5,))
    program = {0: [Op("F", 0, 0), Op("B", 0, 0, reduce=True)]}
    line = simulate(program, [red], {0: 0}, True)[0]
    assert (line.compute_end, line.end) == (3.0, 4.5)
    assert simulate(program, [red], {0: 0}, False)[0].compute_end == 4.5


def test_programs_that_wait_on_each_other_are_refused() -> None:
    cost = StageCost(forward=(1.0,), backward=(1.0,))
    programs = {0: [Op("B", 0, 0), Op("F", 0, 0)], 1: [Op("F", 1, 0), Op("B", 1, 0)]}
    with pytest.raises(RuntimeError, match="wait on each other forever"):
        simulate(programs, [cost, cost], {0: 0, 1: 1}, overlap=False)


def test_single_stage_orders_are_those_torch_runs() -> None:
    # torch's 1F1B warms up pp - rank forwards, then backward before forward
    cfg = ZeroPPConfig(pp_size=2, schedule="1f1b", num_microbatches=4).resolve(2)
    assert task_orders(cfg)[1] == [
        ("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1),
        ("F", 1, 2), ("B", 1, 2), ("F", 1, 3), ("B", 1, 3),
    ]  # fmt: skip
    assert [k for k, _, _ in task_orders(cfg)[0]] == list("FFBFBFBB")


LAYOUTS = [
    {"dp_shard_size": 4, "num_microbatches": 3},
    {"pp_size": 2, "dp_shard_size": 2, "schedule": "1f1b", "num_microbatches": 4},
    {"pp_size": 2, "dp_shard_size": 2, "schedule": "interleaved_1f1b", "num_microbatches": 4},
    {"pp_size": 2, "dp_shard_size": 2, "schedule": "zeropp", "num_microbatches": 8,
     "grad_reduce": "unit"},
    {"pp_size": 2, "dp_shard_size": 2, "schedule": "zeropp", "num_microbatches": 6,
     "split_backward": False, "grad_reduce": "microbatch"},
]  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_programs_gather_and_reduce_as_often_as_the_comm_prediction(layout: dict) -> None:
    # plan.comm's counts are checked against counted runs (tests/distributed/test_planner.py)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, seq_len=16, dim=32, num_heads=2, num_layers=4))
    cfg = ZeroPPConfig(**layout).resolve(4)
    # FSDP units with parameters, per stage
    units = [len(u.blocks) + bool(u.rest) for u in stage_units(model, cfg)]
    for rank, program in programs_for(cfg).items():
        comm = predict_comm(model, ZeroPPConfig(**layout), 4, 48, 16)[rank * cfg.dp_size]
        assert (
            sum(units[op.stage] for op in program if op.gather)
            == comm["all_gather"]["dp_shard"]["count"]
        )
        assert (
            sum(units[op.stage] for op in program if op.reduce)
            == comm["reduce_scatter"]["dp_shard"]["count"]
        )


def test_step_time_counts_every_collective_and_the_optimizer() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, seq_len=16, dim=32, num_heads=2, num_layers=4))
    free = Hardware(flops_per_s=1e9, intra_node_Bps=1e30, inter_node_Bps=1e30, node_size=4,
                    latency_s=0.0, memory_Bps=1e30, overlap=False)  # fmt: skip
    slow = Hardware(flops_per_s=1e9, intra_node_Bps=1e6, inter_node_Bps=1e6, node_size=4,
                    latency_s=0.0, memory_Bps=1e30, overlap=False)  # fmt: skip
    cfg = ZeroPPConfig(dp_shard_size=4, num_microbatches=2)
    a = predict_step_time(model, cfg, 4, 8, 16, free)
    b = predict_step_time(model, cfg, 4, 8, 16, slow)
    comm = predict_comm(model, cfg, 4, 8, 16)[0]
    # serial lanes: the slow links add (k-1)/k of every gathered and reduced byte over the link
    moved = (
        3 * comm["all_gather"]["dp_shard"]["bytes"]
        + comm["reduce_scatter"]["dp_shard"]["bytes"] * 3 / 4
    )
    assert b.step_s - a.step_s == pytest.approx(moved / 1e6, rel=1e-9)
    assert a.mfu == pytest.approx(a.model_flops / (a.step_s * 4 * 1e9))
    assert a.bubble == pytest.approx(0.0, abs=1e-12)


def test_resharding_after_forward_gathers_each_stage_once_more_per_micro_batch() -> None:
    # FSDP keeps a backward's weights for the next forward, which reshards them again
    cfg = ZeroPPConfig(pp_size=2, schedule="1f1b", num_microbatches=4, reshard_after_forward=True)
    for ops in programs_for(cfg.resolve(2)).values():
        assert sum(op.gather for op in ops) == 4 + 1


def _llama_like() -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=128, seq_len=64, dim=64, num_heads=4, num_layers=8))


def test_3d_without_tensor_parallelism_is_the_1f1b_prediction() -> None:
    from lightning_zeropp.plan.megatron import predict_3d

    hw = Hardware(flops_per_s=1e12, intra_node_Bps=1e9, inter_node_Bps=1e9, node_size=8,
                  latency_s=0.0, memory_Bps=1e30, optimizer_Bps=1e30)  # fmt: skip
    model = _llama_like()
    three = predict_3d(model, 2, 8, 64, hw, tp=1, pp=2, num_microbatches=4)
    ours = predict_step_time(
        model, ZeroPPConfig(pp_size=2, num_microbatches=4, param_dtype="bf16"), 2, 8, 64, hw
    )
    assert three.step_s == pytest.approx(ours.step_s, rel=1e-12)


def test_3d_tensor_parallel_traffic_is_eight_activations_a_layer_and_micro_batch() -> None:
    # The ZeroPP paper's count: TP moves about 8 s*b*h per layer per micro-batch (2 all-gathers
    # and 2 reduce-scatters each way under sequence parallelism, each (t-1)/t of the activation).
    from lightning_zeropp.plan.megatron import predict_3d

    def hw(bw: float) -> Hardware:
        return Hardware(flops_per_s=1e12, intra_node_Bps=bw, inter_node_Bps=bw, node_size=8,
                        latency_s=0.0, memory_Bps=1e30)  # fmt: skip

    model, m, rows, seq, dim, layers = _llama_like(), 2, 4, 64, 64, 8
    fast = predict_3d(model, 8, rows * m, seq, hw(1e30), tp=8, num_microbatches=m)
    slow = predict_3d(model, 8, rows * m, seq, hw(1e6), tp=8, num_microbatches=m)
    moved = 8 * (7 / 8) * rows * seq * dim * 2 * layers * m  # bf16 bytes
    assert slow.step_s - fast.step_s == pytest.approx(moved / 1e6, rel=1e-9)


def test_stage_zero_runs_its_whole_split_backward_in_w() -> None:
    # torch's PipelineStage skips the first stage's I (no input gradient to compute) and runs
    # the whole backward, with any recomputation, in its W: the model prices it so.
    from lightning_zeropp.plan.simulate import _segment_seconds
    from lightning_zeropp.plan.stage_costs import stage_costs

    cost = StageCost(forward=(1.0, 1.0), backward=(2.0, 4.0), recompute=True,
                     input_grad_in_weight=True)  # fmt: skip
    assert _segment_seconds(cost, "I") == [0.0, 0.0]
    assert _segment_seconds(cost, "W") == [4.0 + 1.0, 2.0 + 1.0]  # units last to first
    other = StageCost(forward=(1.0, 1.0), backward=(2.0, 4.0), recompute=True)
    assert _segment_seconds(other, "I") == [2.0 + 1.0, 1.0 + 1.0]
    assert _segment_seconds(other, "W") == [2.0, 1.0]
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, seq_len=16, dim=32, num_heads=2, num_layers=4))
    cfg = ZeroPPConfig(pp_size=2, schedule="zbv", num_microbatches=4).resolve(2)
    hw = Hardware(flops_per_s=1e9, intra_node_Bps=1e9, inter_node_Bps=1e9, node_size=2)
    costs, _, _ = stage_costs(model, cfg, 8, 16, hw)
    assert [c.input_grad_in_weight for c in costs] == [True, False, False, False]


def test_dualpipev_pairs_count_as_their_two_tasks() -> None:
    # DualPipeV's order pairs a forward with a backward (OVERLAP_F_B); torch runs them in turn,
    # and the simulation needs both (without them it waits forever)
    cfg = ZeroPPConfig(pp_size=2, schedule="dualpipev", num_microbatches=8).resolve(2)
    orders = task_orders(cfg)
    for order in orders.values():
        forwards = [(s, m) for k, s, m in order if k == "F"]
        backwards = [(s, m) for k, s, m in order if k in "BI"]
        assert sorted(forwards) == sorted(backwards) and len(forwards) == 2 * 8
    lines = _run(cfg, 0.5, 1.0)
    assert all(line.compute == pytest.approx(2 * 8 * 1.5) for line in lines.values())
