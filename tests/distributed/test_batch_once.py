"""A batch is made once per pipeline: with a collator that draws (random masking), every stage
of a pipeline steps on its first stage's batch (pp 2 x dp 2, 4 gloo ranks, one launch).

- An Accelerate loop whose processes are seeded apart (`set_seed(seed, device_specific=True)`),
  its collator in the main process and in a loader worker: the losses and trained weights equal
  one process's trained on the first stages' batches (within 1e-5), and every rank's loop reads
  the batch its pipeline trained on.
- `ZeroPPTrainer` over BERT-MLM (dropout 0.1) with `DataCollatorForLanguageModeling(mlm=True)`,
  under `ZEROPP_CHECK_BATCH=1`: the labels the last stage's loss reads are those of the masked
  inputs the first stage read, for every training and evaluation batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.batch_scenarios import MASK, llama_reference
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

STEPS = 4
KEYS = ("input_ids", "labels")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: Any) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("batch_once")
    params = {"out_dir": str(out / "trainer"), "steps": STEPS}
    return launch(4, "batch_scenarios.run", params, out, timeout=600)


def _by_layout(results: list[dict[str, Any]], key: str) -> dict[tuple[int, int], dict]:
    return {(r[key]["pp_rank"], r[key]["dp_rank"]): r[key] for r in results}


@pytest.mark.parametrize("case", ["accelerate", "workers"])
def test_accelerate_loop_with_a_random_collator_matches_one_process(runs, case) -> None:
    ranks = _by_layout(runs, case)
    steps = len(ranks[0, 0]["losses"])
    joined = [  # the first stages' batches: what the pipelines' inputs were
        {k: torch.cat([ranks[0, dp]["batches"][s][k] for dp in (0, 1)]) for k in KEYS}
        for s in range(steps)
    ]
    ref = llama_reference(joined)
    for rank in ranks.values():
        assert rank["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    params = next(r[case]["params"] for r in runs if r[case]["params"])
    for name, value in ref["params"].items():
        torch.testing.assert_close(params[name], value, atol=1e-5, rtol=0, msg=name)
    for dp in (0, 1):  # every stage's loop holds the batch its pipeline trained on
        for a, b in zip(ranks[0, dp]["batches"], ranks[1, dp]["batches"], strict=True):
            for key in KEYS:
                assert torch.equal(a[key], b[key]), f"data-parallel rank {dp}: {key} differs"


def test_trainer_bert_mlm_stages_read_one_mask(runs) -> None:
    ranks = _by_layout(runs, "bert")
    apart, checked = [], 0
    for dp in (0, 1):
        ids, labels = ranks[0, dp]["ids"], ranks[1, dp]["labels"]
        # the STEPS training batches' calls, then the evaluation's, in the same order
        assert len(ids) == len(labels) > STEPS
        for k, (x, y) in enumerate(zip(ids, labels, strict=True)):
            assert x.numel() == y.numel(), f"call {k}: the stages read other rows"
            masked = x.flatten() == MASK
            hidden = y[masked]  # every [MASK] the first stage read has a label at the last
            if (hidden == -100).any():
                apart.append(f"dp {dp} call {k}: {int((hidden == -100).sum())}/{len(hidden)}")
            checked += len(hidden)
    assert checked >= 10, f"only {checked} masked inputs: the check checks little"
    total = len(ranks[0, 0]["ids"]) + len(ranks[0, 1]["ids"])
    assert not apart, (
        f"{len(apart)} of {total} calls: masked inputs of the first stage without a label on "
        f"the last ({', '.join(apart)})"
    )
