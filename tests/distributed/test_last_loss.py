"""A loss computed on the last stage, against one process: the Trainer's `compute_loss_func` and
`label_smoothing_factor` under `ZeroPPTrainer` (pp 2, padded rows whose micro-batches hold
different numbers of labelled tokens) against the plain Trainer in one process (loss per logged
step, evaluation loss, the saved weights); `gradient_checkpointing=True` mapped onto the
library's activation checkpointing. One launch of 2 ranks, one of 1 rank for the references.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

PP = {"pp_size": 2, "num_microbatches": 2}
EVAL = {"eval_strategy": "steps", "eval_steps": 2}
CASES = [
    # the window's count: two batches accumulated, the loss divided by their labelled tokens
    {
        "id": "func",
        "func": True,
        "plugin": PP,
        "script": {"rows": "padded", "args": {"gradient_accumulation_steps": 2}},
    },
    # label smoothing, evaluated; the Trainer's gradient checkpointing (TRL's SFTConfig default)
    {
        "id": "smooth",
        "plugin": PP,
        "script": {
            "rows": "padded",
            "args": {"label_smoothing_factor": 0.1, "gradient_checkpointing": True, **EVAL},
        },
    },
]
# dp 2 (pp 1): 7 eval rows, 4 a batch: the last batch's second data-parallel rank reads 1 row
# and 1 row Accelerate repeats, which the global batch's mean must not count
CASES.append(
    {
        "id": "smooth_dp",
        "plugin": {"pp_size": 1, "num_microbatches": 1},
        "script": {
            "rows": "padded",
            "eval_rows": 7,
            "args": {"label_smoothing_factor": 0.1, **EVAL},
        },
    }
)
# one process reads the 2 processes' per-device batches at once
ONE = {"per_device_train_batch_size": 4, "per_device_eval_batch_size": 4}
REFERENCES = [{**case, "plugin": None, "script": {**case["script"], **ONE}} for case in CASES]
# an Accelerate loop with its own loss (per-row weights, a metric): `model.use_loss` at pp 2
CASES.append({"id": "loop", "loop": PP})
REFERENCES.append({"id": "loop", "loop": None})
# the loop at pp 1 x dp 2 evaluated on 7 rows, 4 a batch: the last batch's second data-parallel
# rank reads 1 row and 1 row Accelerate repeats
CASES.append({"id": "loop_dp", "loop": {"pp_size": 1, "num_microbatches": 1}, "eval": 7})
REFERENCES.append({"id": "loop_dp", "loop": None, "eval": 7})
# an asked chunk of the head and loss, which a loss of its own on the whole logits cannot honour
CASES.append({"id": "chunked_loop", "loop": {**PP, "loss_chunk": 64}})
# last (a rank fails: the world ends there): the loop at dp 2 whose eval collator makes two
# rows of a sample, so rank 1's repeated sample cannot be told apart (bad-inputs row 186d)
CASES.append(
    {
        "id": "loop_dp_doubled",
        "loop": {"pp_size": 1, "num_microbatches": 1},
        "eval": 7,
        "doubled": True,
    }
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("last_loss")
    two = launch(
        2,
        "last_loss_scenarios.run",
        {"cases": CASES, "out_dir": str(out / "two")},
        out / "two",
        timeout=600,
    )
    one = launch(
        1,
        "last_loss_scenarios.run",
        {"cases": REFERENCES, "out_dir": str(out / "one")},
        out / "one",
        timeout=600,
    )
    return two, one[0]


def _same_training(got: dict, ref: dict) -> None:
    steps = [log for log in got["logs"] if "loss" in log]
    want = [log for log in ref["logs"] if "loss" in log]
    assert len(steps) == len(want) == 4 and got["steps"] == ref["steps"] == 4
    for a, b in zip(steps, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5, abs=1e-5)
    assert got["weights"].keys() == ref["weights"].keys()
    for name, value in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, rtol=0, atol=1e-5, msg=name)


def _same_evaluations(got: dict, ref: dict) -> list[float]:
    """The two evaluations' `eval_loss` against one process's, within 1e-5; got's values."""
    evals = [log["eval_loss"] for log in got["logs"] if "eval_loss" in log]
    want = [log["eval_loss"] for log in ref["logs"] if "eval_loss" in log]
    assert len(evals) == len(want) == 2
    assert evals == pytest.approx(want, abs=1e-5)
    return evals


def test_compute_loss_func_matches_one_process(runs):
    two, one = runs
    _same_training(two[0]["func"], one["func"])
    steps = [log for log in two[0]["func"]["logs"] if "loss" in log]
    for rank in two:  # every rank logs the same numbers
        assert [log for log in rank["func"]["logs"] if "loss" in log] == steps


def test_label_smoothing_matches_one_process(runs):
    two, one = runs
    got, ref = two[0]["smooth"], one["smooth"]
    _same_training(got, ref)
    _same_evaluations(got, ref)


def test_a_short_last_eval_batch_over_data_parallel_ranks_matches_one_process(runs):
    two, one = runs
    got, ref = two[0]["smooth_dp"], one["smooth_dp"]
    _same_training(got, ref)
    evals = _same_evaluations(got, ref)
    for rank in two:  # every rank logs the same numbers
        assert [
            log["eval_loss"] for log in rank["smooth_dp"]["logs"] if "eval_loss" in log
        ] == evals


def test_an_accelerate_loop_with_its_own_loss_matches_one_process(runs):
    two, one = runs
    got, ref = two[0]["loop"], one["loop"]
    assert len(got["logs"]) == len(ref["logs"]) == 3
    for a, b in zip(got["logs"], ref["logs"], strict=True):
        assert a.keys() == b.keys() == {"loss", "accuracy"}
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["accuracy"] == pytest.approx(b["accuracy"], abs=1e-6)
    for rank in two:  # the metrics reach every rank
        assert rank["loop"]["logs"] == got["logs"]
    for name, value in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, rtol=0, atol=1e-5, msg=name)


def test_gradient_checkpointing_is_the_librarys(runs):
    two, _ = runs
    for rank in two:
        assert rank["smooth"]["checkpointing"] == "all"  # ZeroPP recomputes every block
        assert rank["smooth"]["args_checkpointing"] is False  # the Trainer's own is off


def test_an_asked_loss_chunk_with_a_loss_of_its_own_is_refused_on_every_rank(runs):
    two, _ = runs
    for rank in two:
        error = rank["chunked_loop"]["error"]
        assert (
            "loss_chunk=64 asks for the head and the loss in chunks, but a loss computed on "
            in (error)
        )
        assert "(use_loss: a loop's own loss, the Trainer's compute_loss_func" in error
        assert "leave loss_chunk unset (None: chunks where the run can) or set it to 0" in error


def test_an_accelerate_loop_evaluating_a_short_last_batch_matches_one_process(runs):
    two, one = runs
    got, ref = two[0]["loop_dp"], one["loop_dp"]
    for a, b in zip(got["logs"], ref["logs"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], abs=1e-5)
    assert [rank["loop_dp"]["eval_loss"] for rank in two] == [got["eval_loss"]] * 2


def test_repeats_that_cannot_be_told_apart_are_named_on_every_rank(runs):
    two, _ = runs
    holder, other = two[1]["loop_dp_doubled"], two[0]["loop_dp_doubled"]
    assert holder["type"] == "ValueError"
    assert (
        "the last evaluation batch of data-parallel rank 1 holds 2 samples, 1 of them "
        in (holder["error"])
    )
    assert "4 rows, which are not one per sample" in holder["error"]
    assert other["type"] == "PeerFailedError"  # the rank without repeats: told which and why
    assert "rank 1" in other["error"] and "ValueError" in other["error"]
