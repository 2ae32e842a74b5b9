"""TRL's DPO script under `ZeroPPDPOTrainer` (pp 2, 2 gloo ranks) against TRL's own
`DPOTrainer` in one process: the loss, TRL's logged metrics (rewards/*, logps/*, logits/*,
entropy, mean_token_accuracy, num_tokens) per step and the saved weights (the adapters under
LoRA), with the reference log-probabilities precomputed or run each step; and what is not
pipelined refused on every rank."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import against_one_process
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed
pytest.importorskip("trl")

PP = {"pp_size": 2, "num_microbatches": 2}
LORA_B = {"init_lora_weights": False}  # lora_B random, not zero
CASES = [
    # 7 eval pairs, 4 a batch: a last batch of 3 pairs runs as one micro-batch of whole pairs
    {"id": "sigmoid", "plugin": PP, "batch": 2, "eval": True, "eval_pairs": 7},
    # one pair per micro-batch, two batches per update
    {"id": "accumulated", "plugin": PP, "batch": 1, "accumulation": 2},
    # DPOConfig's default: TRL's reference model (the policy's path loaded) run each step,
    # here forward-only through the policy's pipeline with the reference's weights swapped in
    {
        "id": "per_step",
        "plugin": PP,
        "batch": 2,
        "accumulation": 2,
        "from_path": True,
        "eval": True,
        "args": {"precompute_ref_log_probs": False},
    },
    # LoRA adapters (peft_config as TRL's examples pass it): TRL's reference is the policy with
    # its adapters disabled, here every lora_B zero in the stages, run each step (inside an
    # accumulation window, whose gradients it holds out)
    {
        "id": "lora",
        "plugin": PP,
        "batch": 2,
        "accumulation": 2,
        "eval": True,
        "init": {"peft_config": {}},
        "args": {"precompute_ref_log_probs": False},
    },
    # precomputed by TRL's pass (adapters disabled) before the split; lora_B not zero at the
    # start, so the policy differs from the reference from the first step
    {"id": "lora_precomputed", "plugin": PP, "batch": 2, "init": {"peft_config": LORA_B}},
]
REFERENCES = [{**case, "plugin": None, "batch": 2 * case["batch"]} for case in CASES]
# slow: a resume from the checkpoint of step 2 by a new trainer, against TRL's one-process script
# resumed alike and against the run uninterrupted; the reference precomputed, and run each step
# (TRL's reference loaded from the policy's initial path: the resumed run's must be that one,
# not the checkpoint's policy)
SAVED = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2}
RESUMED = [
    {"id": "resumed", "plugin": PP, "batch": 2, "resume": 2, "args": SAVED},
    {
        "id": "resumed_per_step",
        "plugin": PP,
        "batch": 2,
        "accumulation": 2,
        "from_path": True,
        "resume": 2,
        "args": {**SAVED, "precompute_ref_log_probs": False},
    },
]
REFUSED = [
    {"id": "hinge", "args": {"loss_type": ["hinge"]}, "want": "loss_type=['hinge']"},
    {
        "id": "sync_ref_model",
        "args": {"precompute_ref_log_probs": False, "sync_ref_model": True},
        "want": "sync_ref_model=True (the reference moved towards the policy",
    },
    {
        "id": "evaluate",
        "refused": "evaluate",
        "want": "evaluate(dataset) with precompute_ref_log_probs=True once the pipeline is built",
    },
    {"id": "predict", "refused": "predict", "want": "predict() is not supported"},
    {
        "id": "deeper_ref",
        "args": {"precompute_ref_log_probs": False},
        "init": {"ref_model": "deeper"},
        "want": "the reference model has 18 weights the policy has not ('model.layers.4.",
    },
    {
        "id": "peft_model",
        "init": {"model": "peft"},
        "want": "a PeftModel passed as the model is not pipelined: TRL then adds a 'ref' adapter",
    },
    {
        "id": "lora_ref_model",
        "init": {"peft_config": {}, "ref_model": "same"},
        "want": "peft_config with a ref_model is not pipelined",
    },
    {"id": "dora", "init": {"peft_config": {"use_dora": True}}, "want": "use_dora=True is not"},
    {
        "id": "modules_to_save",
        "init": {"peft_config": {"modules_to_save": ["lm_head"]}},
        "want": "modules_to_save=['lm_head'] is not pipelined",
    },
    {  # TRL's reference (the policy, adapters disabled, in training mode) would draw it
        "id": "attention_dropout",
        "model_config": {"attention_dropout": 0.1},
        "args": {"precompute_ref_log_probs": False},
        "init": {"peft_config": {}},
        "want": "attention_dropout=0.1 in the model's config with a PEFT model",
    },
    # 3 pairs per device x pp 2 = 6 pairs: 4 micro-batches would split a pair (the loader's
    # check of rows per micro-batch refuses it: a row of TRL's dataset is a pair)
    {
        "id": "pairs_split",
        "plugin": {"pp_size": 2, "num_microbatches": 4},
        "batch": 3,
        "refused": "train",
        "want": "6 rows per batch (batch_size=6, dp_size=1, split_batches=False), which do not "
        "split into num_microbatches=4",
    },
]
METRICS = (
    "loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "entropy",
    "mean_token_accuracy",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl_dpo")
    refused = [{"plugin": PP, "batch": 2, "refused": "init", **case} for case in REFUSED]
    return against_one_process(out, 2, "trl_dpo_scenarios.run", refused + CASES, REFERENCES)


def check_equal(got: dict, ref: dict, ranks: list[dict], steps_run: int = 3) -> None:
    """Loss and TRL's metrics of every logged step, on every rank, and the saved weights."""
    steps = [log for log in got["logs"] if "loss" in log]
    want = [log for log in ref["logs"] if "loss" in log]
    assert len(steps) == len(want) == steps_run
    for a, b in zip(steps, want, strict=True):
        assert set(b) <= set(a), set(b) - set(a)  # every metric TRL logs
        for key in METRICS:
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
        assert a["num_tokens"] == b["num_tokens"]
    evals = [log for log in got["logs"] if "eval_loss" in log]
    want_evals = [log for log in ref["logs"] if "eval_loss" in log]
    assert len(evals) == len(want_evals)
    assert len(evals) == (2 if any("eval_loss" in log for log in ref["logs"]) else 0)
    for a, b in zip(evals, want_evals, strict=True):  # TRL's eval loss and metrics
        for key in set(b) - {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}:
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
    for rank in ranks:
        assert [log for log in rank["logs"] if "loss" in log] == steps
    for name, value in ref["weights"].items():
        torch.testing.assert_close(
            got["weights"][name], value, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("case", [case["id"] for case in CASES])
def test_dpo_matches_trl_in_one_process(runs, case):
    two, one = runs
    check_equal(two[0][case], one[case], [rank[case] for rank in two])


@pytest.mark.slow
def test_dpo_pp2_dp2_matches_trl_in_one_process(tmp_path):
    """4 ranks, pp 2 x dp 2: the pair count, tokens and metrics summed over data-parallel
    ranks; the per-step reference's weights (a ref_model's, LoRA's zero lora_B) cut into the
    data-parallel shards, a resume included."""
    cases = [
        # 7 eval pairs, 4 a batch: the last batch's second data-parallel rank reads 1 pair
        # and 1 pair Accelerate repeats
        {"id": "dp2", "plugin": PP, "batch": 1, "eval": True, "eval_pairs": 7},
        {**CASES[2], "id": "dp2_per_step", "batch": 1},
        # resumed from checkpoint-2: the reference's shards the original's
        {**RESUMED[-1], "id": "dp2_resumed_per_step", "batch": 1},
        # LoRA: the zero lora_B state cut into the data-parallel shards
        {**CASES[3], "id": "dp2_lora", "batch": 1},
    ]
    refs = [{**case, "plugin": None, "batch": 4} for case in cases]
    four, one = against_one_process(tmp_path, 4, "trl_dpo_scenarios.run", cases, refs)
    for case in cases[:2]:
        name = case["id"]
        check_equal(four[0][name], one[name], [rank[name] for rank in four])
    resumed_matches(four, one, "dp2_resumed_per_step")


@pytest.mark.slow
def test_dpo_resumed_matches_trl_and_the_run_uninterrupted(tmp_path):
    refs = [{**case, "plugin": None, "batch": 4} for case in RESUMED]
    two, one = against_one_process(tmp_path, 2, "trl_dpo_scenarios.run", RESUMED, refs)
    for case in RESUMED:
        resumed_matches(two, one, case["id"])


def resumed_matches(ranks: list[dict], one: dict, name: str) -> None:
    """Steps 3 and 4, after the resume (the rewards against the original reference), as TRL's
    resumed run and as the run uninterrupted."""
    check_equal(ranks[0][name], one[name], [rank[name] for rank in ranks], steps_run=2)
    resumed, uninterrupted = ranks[0][name], ranks[0][name]["uninterrupted"]
    after = [log for log in uninterrupted["logs"] if "loss" in log][2:]
    for a, b in zip([log for log in resumed["logs"] if "loss" in log], after, strict=True):
        for key in (*METRICS, "epoch"):  # the data position too
            assert a[key] == pytest.approx(b[key], abs=1e-5), (name, key)
    for weight, value in uninterrupted["weights"].items():
        torch.testing.assert_close(resumed["weights"][weight], value, rtol=0, atol=1e-5, msg=weight)


@pytest.mark.parametrize("case", REFUSED, ids=[case["id"] for case in REFUSED])
def test_dpo_refuses_what_is_not_pipelined(runs, case):
    two, _ = runs
    for rank in two:
        error = rank[case["id"]]["error"]
        assert error is not None
        assert error.startswith("ZeroPPDPOTrainer:") or case["id"] == "pairs_split"
        assert case["want"] in error


def test_a_ref_model_that_fits_one_stage_only_is_refused_on_every_rank(tmp_path):
    """Each rank checks its own stages' weights against the reference: the verdict is agreed, so
    the rank whose stages fit raises too instead of waiting in the first step's collectives."""
    seen = launch(2, "reference_scenarios.mismatch_on_rank_1", {}, tmp_path, timeout=120)
    assert seen[1].startswith("ZeroPPDPOTrainer: the reference model's 'layers.1.weight' is of")
    assert seen[0] == f"rank 1: {seen[1]}"
