"""TRL's reward-model script under `ZeroPPRewardTrainer` (pp 2 on 2 gloo ranks; pp 2 x dp 2 on
4) against TRL's own `RewardTrainer` in one process: loss, TRL's metrics (accuracy, margin,
min/mean/max reward, num_tokens) and grad norm per logged step on every rank, and the saved
weights; plain pairs, pairs with TRL's `margin` column and `center_rewards_coefficient`,
evaluation (eval loss and TRL's eval metrics), gradient accumulation, and LoRA adapters with the score head trained in full (`peft_config`). Refused, on every rank: a batch whose pairs do not split into the
micro-batches, predict(); an unchanged `RewardTrainer` under ZEROPP_* variables."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import against_one_process

pytestmark = pytest.mark.distributed
pytest.importorskip("trl")

PP = {"pp_size": 2, "num_microbatches": 2}
MARGIN = {"margin": True, "args": {"center_rewards_coefficient": 0.1}}
# the default run: margins and centring cover the plain pairs' path too (suite time)
CASES = [
    {"id": "margin", "plugin": PP, "batch": 2, **MARGIN},
    # TRL's evaluation after steps 2 and 3 (7 pairs, 4 a batch: two micro-batches of 2 pairs,
    # then a last batch of 3 pairs as one micro-batch of whole pairs)
    {
        "id": "evaluated",
        "plugin": PP,
        "batch": 2,
        "evaluate": True,
        "eval_pairs": 7,
        "args": {"eval_strategy": "steps", "eval_steps": 2},
    },
]
MORE = [  # slow: a launch of their own
    {"id": "plain", "plugin": PP, "batch": 2},
    {"id": "accumulated", "plugin": PP, "batch": 2, "args": {"gradient_accumulation_steps": 2}},
    {"id": "lora", "plugin": PP, "batch": 2, "lora": True},  # adapters + the score head
]
REFUSED = [
    # 5 pairs, 4 a step: the last step's single pair cannot be cut into 2 micro-batches
    {"id": "short", "plugin": PP, "batch": 2, "pairs": 5, "expect_error": True},
    {"id": "predict", "plugin": PP, "batch": 2, "predict": True, "expect_error": True},
    # the head pools each row at its last non-pad token, on one CP rank's part of the sequence
    {
        "id": "cp",
        "plugin": {"pp_size": 1, "cp_size": 2, "num_microbatches": 2},
        "batch": 2,
        "expect_error": True,
    },
]
WIDE = [MORE[0], CASES[0], CASES[1]]  # 4 ranks: pp 2 x dp 2, evaluation included
# slow: a resume from the checkpoint of step 2 by a new trainer (margins and centring on),
# against TRL's one-process script resumed alike and against the run uninterrupted
RESUMED = {
    "id": "resumed",
    "plugin": PP,
    "batch": 2,
    **MARGIN,
    "resume": 2,
    "args": {
        **MARGIN["args"],
        "max_steps": 4,
        "save_strategy": "steps",
        "save_steps": 2,
    },
}


def references(cases: list[dict], batch: int) -> list[dict]:
    return [{**case, "plugin": None, "batch": batch} for case in cases]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl_reward")
    scenario = "trl_reward_scenarios.run"
    return against_one_process(out, 2, scenario, CASES + REFUSED, references(CASES, 4))


def _matches(ranks: list[dict], ref: dict, case: str, steps_run: int = 3) -> None:
    got = ranks[0][case]
    steps = [log for log in got["logs"] if "loss" in log]
    want = [log for log in ref[case]["logs"] if "loss" in log]
    assert len(steps) == len(want) == steps_run
    for a, b in zip(steps, want, strict=True):
        for key in ("loss", "grad_norm", "accuracy", "margin"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
        for key in ("min_reward", "mean_reward", "max_reward"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
        assert a["num_tokens"] == b["num_tokens"]
    evals = [log for log in got["logs"] if "eval_loss" in log]
    want_evals = [log for log in ref[case]["logs"] if "eval_loss" in log]
    assert len(evals) == len(want_evals) == (2 if case == "evaluated" else 0)
    for a, b in zip(evals, want_evals, strict=True):  # TRL's eval loss and metrics
        for key in set(b) - {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}:
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
    for rank in ranks:  # every rank logs the same numbers
        assert [log for log in rank[case]["logs"] if "loss" in log] == steps
    for name, value in ref[case]["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("case", [c["id"] for c in CASES])
def test_reward_matches_trl_in_one_process(two, case):
    ranks, one = two
    _matches(ranks, one, case)


def test_pairs_that_do_not_split_into_micro_batches_are_refused_on_every_rank(two):
    ranks, _ = two
    for rank in ranks:
        error = rank["short"]["error"]
        assert "a batch of 1 chosen/rejected pairs (2 rows)" in error
        assert "num_microbatches=2" in error and "dataloader_drop_last=True" in error


def test_predict_is_refused_on_every_rank(two):
    ranks, _ = two
    for rank in ranks:
        error = rank["predict"]["error"]
        assert "predict() is not supported: the rewards exist on the last stage only" in error


def test_context_parallelism_is_refused_on_every_rank(two):
    ranks, _ = two
    for rank in ranks:
        error = rank["cp"]["error"]
        assert error.startswith("ZeroPPRewardTrainer: cp_size=2 (context parallelism) is not")
        assert "LlamaForSequenceClassification pools each row at its last non-pad token" in error


def _against_one_process(tmp_path, world: int, cases: list[dict]) -> None:
    scenario, refs = "trl_reward_scenarios.run", references(cases, 2 * world)
    ranks, one = against_one_process(tmp_path, world, scenario, cases, refs)
    for case in cases:
        _matches(ranks, one, case["id"])


@pytest.mark.slow
def test_reward_with_accumulation_or_lora_matches_trl_in_one_process(tmp_path):
    _against_one_process(tmp_path, 2, MORE)


@pytest.mark.slow
def test_reward_at_pp2_dp2_matches_trl_in_one_process(tmp_path):
    """WIDE, and a resume at pp 2 x dp 2."""
    scenario, cases = "trl_reward_scenarios.run", [*WIDE, RESUMED]
    ranks, one = against_one_process(tmp_path, 4, scenario, cases, references(cases, 8))
    for case in WIDE:
        _matches(ranks, one, case["id"])
    _resumed_matches(ranks, one)


@pytest.mark.slow
def test_reward_resumed_matches_trl_and_the_run_uninterrupted(tmp_path):
    scenario = "trl_reward_scenarios.run"
    ranks, one = against_one_process(tmp_path, 2, scenario, [RESUMED], references([RESUMED], 4))
    _resumed_matches(ranks, one)


def _resumed_matches(ranks: list[dict], one: dict) -> None:
    _matches(ranks, one, "resumed", steps_run=2)  # steps 3 and 4, after the resume
    resumed, uninterrupted = ranks[0]["resumed"], ranks[0]["resumed"]["uninterrupted"]
    after = [log for log in uninterrupted["logs"] if "loss" in log][2:]
    keys = ("loss", "grad_norm", "accuracy", "margin", "min_reward", "mean_reward", "max_reward")
    for a, b in zip([log for log in resumed["logs"] if "loss" in log], after, strict=True):
        for key in (*keys, "epoch"):  # the data position too
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
    for name, value in uninterrupted["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], value, rtol=0, atol=1e-5, msg=name)


GUARDED = """
import site
site.addsitedir({site!r})
from transformers import AutoConfig, AutoModelForSequenceClassification
from datasets import Dataset
from trl import RewardConfig, RewardTrainer
from tests.distributed.trainer_script import TINY, tokenizer

model = AutoModelForSequenceClassification.from_config(
    AutoConfig.for_model("llama", **TINY, num_labels=1))
data = Dataset.from_dict({{"chosen_ids": [[1, 2, 3]] * 4, "rejected_ids": [[4, 5]] * 4}})
args = RewardConfig(output_dir={out!r}, use_cpu=True, report_to=[], max_steps=1)
try:
    RewardTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer())
    print("REWARD built")
except ValueError as err:
    print("REWARD refused:", err)
"""


def test_the_guard_names_the_zeropp_reward_class():
    from trl import RewardTrainer

    from _lightning_zeropp_guard import message

    text = message(RewardTrainer, {"ZEROPP_PP_SIZE": "2"})
    assert "RewardTrainer (trl) is transformers' Trainer without ZeroPP" in text
    assert "import ZeroPPRewardTrainer from lightning_zeropp.trl" in text


@pytest.mark.slow  # a fresh interpreter importing TRL: the guard's wrapping itself is generic
def test_an_unchanged_reward_trainer_under_zeropp_variables_is_refused(tmp_path):
    from tests.unit.test_env_guard import _run

    out = _run(tmp_path, {"ZEROPP_PP_SIZE": "2"}, GUARDED)
    refused = next(line for line in out.splitlines() if line.startswith("REWARD refused:"))
    assert "ZEROPP_PP_SIZE=2 is set, but RewardTrainer (trl) is transformers' Trainer" in refused
    assert "import ZeroPPRewardTrainer from lightning_zeropp.trl" in refused
