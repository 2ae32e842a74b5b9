"""Activation offload leaves the numbers bit-identical and moves the offloading ranks' saved
activations off the device's count; per-rank recompute touches only the ranks it names.

One launch of 4 gloo ranks runs every case twice, with its offload setting and with offload off,
from the same model and batches (`offload_scenarios.pairs`): losses and every parameter must be
exactly equal. On CPU the device and the host are one memory, so what is checked is the
accounting: the memory report's activation peak (what stays on the device) drops on the
offloading ranks, the host peak counts what moved, nothing stays on the host after a step, and
the other ranks' figures are those of the run without offload.

The same launch trains the head and the loss in chunks (`chunked_scenarios.pairs`) under the
schedules that split backward into input- and weight-gradient tasks, against whole logits and
one process.
"""

from __future__ import annotations

import pytest
import torch

from lightning_zeropp.core import ZeroPPConfig
from lightning_zeropp.core.settings.placement import splits_backward
from lightning_zeropp.core.settings.ranks import stage_rank
from lightning_zeropp.models import GPT
from lightning_zeropp.plan import activation_peaks
from tests.distributed.chunked_scenarios import STEPS
from tests.distributed.common import BIG_HEAD, GLOBAL_BATCH, make_batches, make_model, reference
from tests.distributed.conftest import case_of, selected_cases, slow_case
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

CASES = [
    # 1F1B: ranks 0 and 1 hold 4 and 3 micro-batches in flight, ranks 2 and 3 hold 2 and 1
    {"id": "pp4-1f1b-auto", "layout": {"pp_size": 4, "num_microbatches": 4,
                                       "offload_activations": "auto"}},
    # split backward: the input-gradient task and the weight-gradient task both unpack
    {"id": "pp2-dp2-zbv-on", "layout": {"pp_size": 2, "dp_shard_size": 2, "schedule": "zbv",
                                        "num_microbatches": 4, "offload_activations": True}},
    # pipeline ranks named (as the planner names them)
    {"id": "pp4-zeropp-ranks", "layout": {"pp_size": 4, "schedule": "zeropp",
                                          "num_microbatches": 8, "offload_activations": [0, 2]}},
    # recompute on pipeline rank 0 only, offload on rank 1 only ("auto" under pp 2)
    {"id": "pp2-dp2-interleaved-recompute0", "layout": {
        "pp_size": 2, "dp_shard_size": 2, "schedule": "interleaved_1f1b", "num_microbatches": 4,
        "activation_checkpointing": True, "recompute_ranks": [0], "offload_activations": "auto"}},
]  # fmt: skip


# The head and the loss in chunks of 5 tokens (a micro-batch has 32) where backward is split
# in two passes: the input pass computes the head's weight gradient too and keeps it for the
# weight pass, which under ZeroPP finds the weights released (`core.step.chunked_loss`).
CHUNKED = [
    {"id": "pp4-zeropp-chunked", "layout": {"pp_size": 4, "schedule": "zeropp",
                                            "num_microbatches": 8, "loss_chunk": 5}},
    {"id": "pp2-dp2-zbv-chunked", "layout": {"pp_size": 2, "dp_shard_size": 2, "schedule": "zbv",
                                             "num_microbatches": 4, "loss_chunk": 5}},
    slow_case({"id": "pp2-dp2-interleaved-zb-chunked", "layout": {
        "pp_size": 2, "dp_shard_size": 2, "schedule": "interleaved_zb", "num_microbatches": 4,
        "loss_chunk": 5}}),
    slow_case({"id": "pp2-dp2-dualpipev-chunked", "layout": {
        "pp_size": 2, "dp_shard_size": 2, "schedule": "dualpipev", "num_microbatches": 4,
        "loss_chunk": 5}}),
    # compiled blocks around the (eager) chunked node, under ZeroPP's split backward: the
    # compiled regions' input pass and the node's stash of the head's weight gradient
    slow_case({"id": "pp2-dp2-zeropp-compile-chunked", "layout": {
        "pp_size": 2, "dp_shard_size": 2, "schedule": "zeropp", "num_microbatches": 4,
        "loss_chunk": 5, "compile": True}}),
]  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("offload")
    params = {"cases": CASES, "chunked": selected_cases(request, CHUNKED)}
    return launch(4, "offload_scenarios.pairs", params, out, timeout=600)


@pytest.fixture(scope="module")
def big_head_reference():
    """One process, whole logits: `GPT(x, targets)`'s mean over the global batch."""
    return reference(
        "adamw", False, STEPS, batches=make_batches(STEPS),
        model_fn=lambda: make_model(config=BIG_HEAD), loss_fn=lambda m, x, y: m(x, y),
    )  # fmt: skip


def dp_size(case: dict) -> int:
    return ZeroPPConfig(**case_of(case)["layout"]).resolve(4).dp_size


@pytest.fixture(scope="module")
def planned_peaks() -> dict[str, dict[str, dict[int, int]]]:
    """Per chunked case, the planner's activation peak per pipeline rank, with the case's chunk
    and with whole logits (`loss_chunk=0`)."""
    with torch.device("meta"):
        model = GPT(BIG_HEAD)
    out = {}
    for case in map(case_of, CHUNKED):
        priced = {}
        for name, chunk in (("chunked", case["layout"]["loss_chunk"]), ("whole", 0)):
            config = ZeroPPConfig(**{**case["layout"], "loss_chunk": chunk})
            priced[name] = activation_peaks(
                model, config, 4, GLOBAL_BATCH, BIG_HEAD.seq_len, transients=False
            )
        out[case["id"]] = priced
    return out


@pytest.mark.parametrize("case", CHUNKED, ids=[case_of(c)["id"] for c in CHUNKED])
def test_chunked_loss_under_split_backward_matches_whole_logits_and_one_process(
    results, big_head_reference, planned_peaks, case
):
    want = big_head_reference
    for rank, result in enumerate(results):
        chunked, whole = (
            result["chunked"][case["id"]]["chunked"],
            result["chunked"][case["id"]]["whole"],
        )
        torch.testing.assert_close(chunked["losses"], whole["losses"], rtol=0, atol=1e-6)
        torch.testing.assert_close(chunked["losses"], want["losses"], rtol=0, atol=1e-5)
        for name, value in chunked["params"].items():
            torch.testing.assert_close(value, whole["params"][name], rtol=0, atol=1e-6)
            torch.testing.assert_close(value, want["params"][name], rtol=0, atol=1e-5)
        # the last stage's activation peak drops by its whole logits (2 rows x 16 tokens x 1280
        # fp32 a micro-batch), which are never kept; the other ranks' is that of whole logits
        if chunked["last"]:
            logits = 2 * 16 * 1280 * 4
            assert chunked["activation_peak"] <= whole["activation_peak"] - logits, rank
        else:
            assert chunked["activation_peak"] == whole["activation_peak"], rank
        if case_of(case)["layout"].get("compile"):
            # compiled code ran (what compiled regions save is not what the planner counts)
            assert chunked["compiled"] > 0 and whole["compiled"] > 0, rank
            continue
        # the planner prices the chunked run's peak on every rank as it prices any run (2%,
        # as tests/distributed/test_planner.py); whole logits priced would miss the last stage
        planned, pp_rank = planned_peaks[case_of(case)["id"]], rank // dp_size(case)
        measured = chunked["activation_peak"]
        assert planned["chunked"][pp_rank] == pytest.approx(measured, rel=0.02), rank
        if chunked["last"]:
            assert planned["whole"][pp_rank] != pytest.approx(measured, rel=0.02), rank


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_offload_is_bit_identical(results, case):
    for rank, result in enumerate(results):
        on, off = result[case["id"]]["on"], result[case["id"]]["off"]
        assert on["losses"] == off["losses"], f"rank {rank}: losses differ"
        assert on["params"].keys() == off["params"].keys()
        for name, value in on["params"].items():
            assert torch.equal(value, off["params"][name]), f"rank {rank}: {name} differs"


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_offloading_ranks_hold_less_on_the_device(results, case):
    cfg = ZeroPPConfig(**case["layout"]).resolve(4)
    offloading = cfg.offload_ranks()
    assert offloading, "every case offloads somewhere"
    for result in results:
        on, off = result[case["id"]]["on"], result[case["id"]]["off"]
        assert off["host_peak"] is None and off["moved"] is None
        if on["pp_rank"] in offloading:
            assert on["moved"] > 0 and on["host_peak"] > 0
            assert on["host_live"] == 0, "the host copies are freed with the graph"
            # what moved is no longer the device's: the device-resident peak drops
            assert on["activation_peak"] < off["activation_peak"] / 2, (on, off)
            assert "offloaded to host" in on["report"]
            # one host copy per storage: q, k and v (views of the fused qkv) and an input read
            # by several nodes are copied once (where blocks recompute, only the saved tensors
            # outside them move: nothing shares a storage there)
            stages = [s for s in range(cfg.num_stages)
                      if stage_rank(cfg.schedule, s, cfg.pp_size) == on["pp_rank"]]  # fmt: skip
            recomputes = any(cfg.recomputes(s) for s in stages)
            assert on["storages"] <= on["tensors"] if recomputes else on["storages"] < on["tensors"]
            if splits_backward(cfg.schedule, cfg.split_backward):  # I and W each read: no prefetch
                assert on["fetched_ahead"] == 0 and on["fetched_late"] >= on["moved"], on
            else:  # every copy read back had started as its backward started (torch's
                # first-step metadata forward is copied and never read: not all was fetched)
                assert on["fetched_late"] == 0 and 0 < on["fetched_ahead"] <= on["moved"], on
        else:
            assert on["host_peak"] is None
            assert on["activation_peak"] == off["activation_peak"]


def test_auto_offloads_the_ranks_holding_the_most():
    assert ZeroPPConfig(pp_size=4, num_microbatches=4, offload_activations="auto").resolve(
        4
    ).offload_ranks() == [0, 1]
    assert (
        ZeroPPConfig(pp_size=2, schedule="zbv", offload_activations="auto")
        .resolve(2)
        .offload_ranks()
        == []
    )


def test_recompute_ranks_recompute_only_there(results):
    case = CASES[3]
    runs = [r[case["id"]]["off"] for r in results]
    peaks = {run["pp_rank"]: run["activation_peak"] for run in runs}
    base = {**case["layout"], "recompute_ranks": None}
    cfg = ZeroPPConfig(**base).resolve(4)
    assert all(cfg.recomputes(s) for s in range(cfg.num_stages))
    cfg = ZeroPPConfig(**case["layout"]).resolve(4)
    assert [cfg.recomputes(s) for s in range(cfg.num_stages)] == [True, False, True, False]
    # rank 0's blocks recompute (they save their inputs only), rank 1's keep everything
    assert peaks[0] < peaks[1], peaks
