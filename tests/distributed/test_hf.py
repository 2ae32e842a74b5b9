"""HF causal LMs (Llama, Mistral, Qwen2) under `Trainer(strategy="zeropp")` match one process, and
their consolidated export reloads with `AutoModelForCausalLM.from_pretrained`.

Layout: pp 2 x dp_shard 2 on 4 gloo ranks, fp32, split="trace" (1F1B; interleaved 1F1B with two
stages per rank for Qwen2). Each case trains 3 steps; checked:
the loss rank 0 logs at every step, every parameter afterwards (within 1e-5 of single-process
training), the model's own `labels=` loss and a logits loss written in the step, validation through
the forward-only schedule, and the exported directory's tensors and logits.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.distributed.common import make_batches, reference, sampler_batches
from tests.distributed.conftest import (
    assert_matches_reference,
    case_of,
    merged_params,
    selected_cases,
    slow_case,
)
from tests.distributed.hf_scenarios import make_hf_model, reference_loss
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

LAYOUT = {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 4}
CASES = [
    # the model's own loss through `labels=` (targets pre-shifted, passed as shift_labels too)
    {"id": "llama-labels", "family": "llama", "loss": "labels", "validate": True},
    # cross-entropy from `.logits` in the step, AdamW (a Llama-shaped family: the slow run)
    slow_case(
        {"id": "mistral-logits-adamw", "family": "mistral", "loss": "logits", "optimizer": "adamw"}
    ),
    # HF's own convention, `model(input_ids=x, labels=x).loss`, shifted inside HF's loss; two
    # stages per rank (4 in all), so stage 0's rotary cos/sin and mask are relayed
    {
        "id": "qwen2-hf-labels-interleaved",
        "family": "qwen2",
        "loss": "hf_labels",
        "layout": {**LAYOUT, "schedule": "interleaved_1f1b"},
    },
]
STEPS = 3


@pytest.fixture(scope="module")
def run(request, tmp_path_factory) -> tuple[list, Path]:
    """All cases in one launch (imports and process group start once)."""
    root = tmp_path_factory.mktemp("hf")
    cases = [
        {"layout": LAYOUT, **c, "export_to": str(root / "export" / c["id"])}
        for c in selected_cases(request, CASES)
    ]
    params = {"cases": cases, "init_process_group": False}
    return launch(4, "hf_scenarios.fit_cases", params, root / "logs", timeout=300), root


def _reference(case: dict) -> dict:
    return _reference_of(case["id"])


@functools.cache
def _reference_of(case_id: str) -> dict:
    case = next(case_of(c) for c in CASES if case_of(c)["id"] == case_id)
    return reference(
        case.get("optimizer", "sgd"),
        False,
        STEPS,
        batches=sampler_batches(STEPS),
        model_fn=lambda: make_hf_model(case["family"]),
        loss_fn=reference_loss(case["loss"]),
    )


@pytest.mark.parametrize("case", CASES, ids=[case_of(c)["id"] for c in CASES])
def test_hf_fit_matches_single_process(run, case):
    results, _ = run
    ref = _reference(case)
    assert_matches_reference(results, case, "logged", batches=sampler_batches(STEPS), ref=ref)
    for rank_result in results:  # training_step's returned loss is the logged one
        got = rank_result[case["id"]]
        torch.testing.assert_close(
            torch.tensor(got["returned"]), torch.tensor(got["logged"]), rtol=0, atol=1e-6
        )
    # The loss really moved: a run that did not train would not match a reference that did.
    assert ref["losses"][0] != ref["losses"][-1]


def test_hf_validation_runs_forward_only_schedule(run):
    results, _ = run
    case = CASES[0]
    model = make_hf_model(case["family"])
    model.load_state_dict(_reference(case)["params"])
    loss = reference_loss(case["loss"])
    with torch.no_grad():  # the val loader is not shuffled: batch k is rows [kB, (k+1)B)
        want = torch.stack([loss(model, x, y) for x, y in make_batches(STEPS)]).mean()
    for rank_result in results:
        got = torch.tensor(rank_result[case["id"]]["val_loss"])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=[case_of(c)["id"] for c in CASES])
def test_hf_export_reloads_with_from_pretrained(run, case):
    from transformers import AutoModelForCausalLM

    results, root = run
    path = root / "export" / case["id"]
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert not list(path.parent.glob(".*tmp-*"))  # written atomically: no temp dir left
    exported = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert exported.config.model_type == case["family"]
    assert exported.config.tie_word_embeddings is False and exported.config.use_cache is True
    trained = merged_params(results, case["id"])
    got = dict(exported.named_parameters())
    assert got.keys() == trained.keys()
    for name, want in trained.items():
        torch.testing.assert_close(got[name].detach(), want, rtol=0, atol=0, msg=name)
    # Same logits as a fresh model holding the merged trained parameters.
    model = make_hf_model(case["family"], seed=123)
    model.load_state_dict(trained)
    x = make_batches(1, seed=5)[0][0]
    with torch.no_grad():
        torch.testing.assert_close(exported(x).logits, model(x).logits, rtol=0, atol=1e-5)
