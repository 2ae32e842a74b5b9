"""TRL's SFT script under `ZeroPPSFTTrainer` (pp 2, 2 gloo ranks) against TRL's own
`SFTTrainer` in one process: loss and TRL's metrics (entropy, mean_token_accuracy, num_tokens)
per logged step and the saved weights, with a completion-only loss over padded rows (and TRL's
evaluation: eval_loss, eval_entropy, eval_mean_token_accuracy), with packed rows, with LoRA
adapters (`peft_config`; the saved adapters compared), and with gradient accumulation."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import against_one_process

pytestmark = pytest.mark.distributed
pytest.importorskip("trl")

PP = {"pp_size": 2, "num_microbatches": 2}
# At dp 2 (or under accumulation) AdamW's first step divides each gradient by its own size, so
# the fp32 rounding of near-zero gradients (lm_head rows), summed in another order (over two
# data-parallel ranks, or four micro-batches against two backward passes), grows to ~7e-5 in the
# weights; under SGD the same runs agree to 1e-8. SGD there, then.
SGD = {"optim": "sgd", "learning_rate": 0.3}
CASES = [
    # with TRL's evaluation after steps 2 and 3 (eval_loss, eval_entropy, ...)
    {
        "id": "completion",
        "plugin": PP,
        "batch": 2,
        "eval": True,
        "args": {"completion_only_loss": True, "eval_strategy": "steps", "eval_steps": 2},
    },
    # evaluated on 7 rows packed into samples of several documents (a short last batch at dp 1:
    # nothing repeated, every document counted)
    {
        "id": "packed",
        "plugin": PP,
        "batch": 2,
        "eval": True,
        "eval_rows": 7,
        "args": {"packing": True, "eval_strategy": "steps", "eval_steps": 2},
    },
    # LoRA adapters (`peft_config`, as TRL's examples pass it): the adapters' weights compared
    {"id": "lora", "plugin": PP, "batch": 2, "lora": True, "args": {"completion_only_loss": True}},
    # two batches per update, completions of uneven lengths: the loss over the window's tokens
    {
        "id": "accumulated",
        "plugin": PP,
        "batch": 2,
        "args": {"completion_only_loss": True, "gradient_accumulation_steps": 2, **SGD},
    },
]
REFERENCES = [{**case, "plugin": None, "batch": 4} for case in CASES]
# slow: a resume from the checkpoint of step 2 by a new trainer, against TRL's one-process script
# resumed alike (TRL's num_tokens restarts from the resume) and against the run uninterrupted
RESUMED = {
    "id": "resumed",
    "plugin": PP,
    "batch": 2,
    "resume": 2,
    "args": {
        "completion_only_loss": True,
        "max_steps": 4,
        "save_strategy": "steps",
        "save_steps": 2,
    },
}
WIDE = [  # 4 ranks: pp 2 x dp 2
    # 7 eval rows, 8 a batch: data-parallel rank 1 reads 3 rows and a row Accelerate repeats
    {**CASES[0], "eval_rows": 7, "args": {**CASES[0]["args"], **SGD}},
    {**RESUMED, "args": {**RESUMED["args"], **SGD}},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl")
    return against_one_process(out, 2, "trl_scenarios.run", CASES, REFERENCES)


def _matches(ranks: list[dict], one: dict, case: str, steps_run: int = 3) -> None:
    got, ref = ranks[0][case], one[case]
    steps = [log for log in got["logs"] if "loss" in log]
    want = [log for log in ref["logs"] if "loss" in log]
    assert len(steps) == len(want) == steps_run
    for a, b in zip(steps, want, strict=True):
        for key in ("loss", "entropy", "mean_token_accuracy", "grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
        assert a["num_tokens"] == b["num_tokens"]
    evals = [log for log in got["logs"] if "eval_loss" in log]
    want_evals = [log for log in ref["logs"] if "eval_loss" in log]
    assert len(evals) == len(want_evals) == (2 if case in ("completion", "packed") else 0)
    for a, b in zip(evals, want_evals, strict=True):
        for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
        assert a["eval_num_tokens"] == b["eval_num_tokens"]
    for rank in ranks:
        assert [log for log in rank[case]["logs"] if "loss" in log] == steps
    for name, value in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("case", [case["id"] for case in CASES])
def test_sft_matches_trl_in_one_process(runs, case):
    two, one = runs
    _matches(two, one, case)


def _against_one_process(tmp_path, world: int, cases: list[dict]) -> tuple[list, dict]:
    references = [{**case, "plugin": None, "batch": 2 * world} for case in cases]
    return against_one_process(tmp_path, world, "trl_scenarios.run", cases, references)


def _resumed_as_uninterrupted(ranks: list[dict]) -> None:
    resumed, uninterrupted = ranks[0]["resumed"], ranks[0]["resumed"]["uninterrupted"]
    after = [log for log in uninterrupted["logs"] if "loss" in log][2:]
    for a, b in zip([log for log in resumed["logs"] if "loss" in log], after, strict=True):
        for key in ("loss", "entropy", "mean_token_accuracy", "grad_norm", "epoch"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key  # the data position too
    for name, value in uninterrupted["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_sft_resumed_matches_trl_and_the_run_uninterrupted(tmp_path):
    ranks, one = _against_one_process(tmp_path, 2, [RESUMED])
    _matches(ranks, one, "resumed", steps_run=2)  # steps 3 and 4, after the resume
    _resumed_as_uninterrupted(ranks)


@pytest.mark.slow
def test_sft_at_pp2_dp2_evaluated_and_resumed_matches_trl_in_one_process(tmp_path):
    ranks, one = _against_one_process(tmp_path, 4, WIDE)
    _matches(ranks, one, "completion")
    _matches(ranks, one, "resumed", steps_run=2)
    _resumed_as_uninterrupted(ranks)
