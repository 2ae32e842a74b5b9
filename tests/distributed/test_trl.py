"""TRL's SFT script under `ZeroPPSFTTrainer` (pp 2, 2 gloo ranks) against TRL's own
`SFTTrainer` in one process: loss and TRL's metrics (entropy, mean_token_accuracy, num_tokens)
per logged step and the saved weights, with a completion-only loss over padded rows (and TRL's
evaluation: eval_loss, eval_entropy, eval_mean_token_accuracy), with packed rows, and with LoRA
adapters (`peft_config`; the saved adapters compared)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed
pytest.importorskip("trl")

PP = {"pp_size": 2, "num_microbatches": 2}
CASES = [
    # with TRL's evaluation after steps 2 and 3 (eval_loss, eval_entropy, ...)
    {
        "id": "completion",
        "plugin": PP,
        "batch": 2,
        "eval": True,
        "args": {"completion_only_loss": True, "eval_strategy": "steps", "eval_steps": 2},
    },
    {"id": "packed", "plugin": PP, "batch": 2, "args": {"packing": True}},
    # LoRA adapters (`peft_config`, as TRL's examples pass it): the adapters' weights compared
    {"id": "lora", "plugin": PP, "batch": 2, "lora": True, "args": {"completion_only_loss": True}},
]
REFERENCES = [{**case, "plugin": None, "batch": 4} for case in CASES]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl")
    two = launch(
        2,
        "trl_scenarios.run",
        {"cases": CASES, "out_dir": str(out / "two")},
        out / "two",
        timeout=600,
    )
    one = launch(
        1,
        "trl_scenarios.run",
        {"cases": REFERENCES, "out_dir": str(out / "one")},
        out / "one",
        timeout=600,
    )
    return two, one[0]


@pytest.mark.parametrize("case", [case["id"] for case in CASES])
def test_sft_matches_trl_in_one_process(runs, case):
    two, one = runs
    got, ref = two[0][case], one[case]
    steps = [log for log in got["logs"] if "loss" in log]
    want = [log for log in ref["logs"] if "loss" in log]
    assert len(steps) == len(want) == 3
    for a, b in zip(steps, want, strict=True):
        for key in ("loss", "entropy", "mean_token_accuracy", "grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
        assert a["num_tokens"] == b["num_tokens"]
    evals = [log for log in got["logs"] if "eval_loss" in log]
    want_evals = [log for log in ref["logs"] if "eval_loss" in log]
    assert len(evals) == len(want_evals) == (2 if case == "completion" else 0)
    for a, b in zip(evals, want_evals, strict=True):
        for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
        assert a["eval_num_tokens"] == b["eval_num_tokens"]
    for rank in two:
        assert [log for log in rank[case]["logs"] if "loss" in log] == steps
    for name, value in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, rtol=0, atol=1e-5, msg=name)
