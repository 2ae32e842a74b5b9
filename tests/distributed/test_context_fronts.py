"""Context parallelism (cp_size > 1) through each front reproduces one process: loss at every
step (returned and logged), every parameter after clipping, and the validation loss, within 1e-5,
on 4 gloo ranks in one launch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.common import lm_loss, make_batches, make_model, reference, sampler_batches
from tests.distributed.conftest import (
    as_params,
    case_of,
    merged_params,
    selected_cases,
    slow_case,
)
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

LIGHTNING = [
    {"id": "lightning-gpt-pp2-cp2", "layout": {"pp_size": 2, "cp_size": 2, "num_microbatches": 2}},
]


# run_clm's loop under ZeroPPAccelerator: right-padded rows (padded to a multiple of 2 x cp),
# clipping, a warm-up + cosine schedule, and run_clm's eval (gather_for_metrics of each
# process's loss); one process trains on the 4 processes' per-device batches at once
PAD = {"pad_to_multiple_of": 4}
ONE = {"per_device_train_batch_size": 8, "per_device_eval_batch_size": 2}
ACCELERATE = [
    {"id": "accelerate-llama-pp2-cp2", "args": PAD,
     "plugin": {"pp_size": 2, "cp_size": 2, "num_microbatches": 2}},
]  # fmt: skip


# ZeroPPTrainer on right-padded rows (lengths padded to multiples of 8 by seq_buckets),
# clipped, accumulating 2 batches, evaluated at steps 2 and 4 (token accuracy from the gathered
# logits), then predict(); one process trains on the global batch of 8 rows
TRAINER_ONE_BATCH = {"per_device_train_batch_size": 8, "per_device_eval_batch_size": 8}
TRAINER = [
    {"id": "trainer-llama-pp2-cp2",
     "plugin": {"pp_size": 2, "cp_size": 2, "num_microbatches": 2, "seq_buckets": 8},
     "script": {"rows": "padded", "predict": True,
                "args": {"max_grad_norm": 0.3, "gradient_accumulation_steps": 2,
                         "eval_strategy": "steps", "eval_steps": 2}}},
]  # fmt: skip
# a loss of the loop's or the Trainer's own, computed on the last stage from the whole sequences
# (`use_loss`) at pp 2 x cp 2, against one process reading the global batch of 8 rows: a
# run_clm-style loop with per-row weights and a metric (rows padded to multiples of 2 x cp),
# evaluated; ZeroPPTrainer's compute_loss_func (a z-loss) accumulating 2 batches, and its label
# smoothing, each evaluated at steps 2 and 4
LOSS_CP2 = {"pp_size": 2, "cp_size": 2, "num_microbatches": 2}
LOOP = {"multiple": 4, "train_rows": 24, "eval": 16}
EVALUATED = {"eval_strategy": "steps", "eval_steps": 2}
LAST_LOSS = [
    {"id": "cp-loop", "loop": LOSS_CP2, **LOOP},
    # cp 2 x dp_shard 2 (pp 1): the count over data-parallel ranks only, each CP rank computing
    # the whole loss; FSDP's group is dp_shard x cp
    {"id": "cp-dp-loop", "loop": {"pp_size": 1, "cp_size": 2, "dp_shard_size": 2,
                                  "num_microbatches": 2}, **LOOP},
    {"id": "cp-func", "func": True, "plugin": {**LOSS_CP2, "seq_buckets": 8},
     "script": {"rows": "padded", "args": {"gradient_accumulation_steps": 2, **EVALUATED}}},
    # SGD: under AdamW one element of up_proj (a near-zero gradient, summed in another order
    # over the CP ranks) lands 1.3e-5 off after AdamW's division by its own size (loss and grad
    # norm agree to 1e-7), as test_trl.py's SGD note describes
    slow_case({"id": "cp-smooth", "plugin": {**LOSS_CP2, "seq_buckets": 8},
               "script": {"rows": "padded",
                          "args": {"label_smoothing_factor": 0.1, **EVALUATED, "optim": "sgd",
                                   "learning_rate": 0.3}}}),
]  # fmt: skip


def _one_process(case: dict[str, Any]) -> dict[str, Any]:
    """A LAST_LOSS case's reference: one process reading the global batch of 8 rows."""
    if "loop" in case:
        return {**case, "loop": None, "rows": 8}
    return {**case, "plugin": None, "script": {**case["script"], **TRAINER_ONE_BATCH}}


# TRL's SFT (completion-only loss, evaluated at steps 2 and 3) at pp 2 x cp 2, rows padded to
# multiples of 2 x cp by TRL's collator, against TRL's SFTTrainer in one process on the 8-row batch.
# With SFTConfig's default gradient checkpointing: the blocks recompute under the CP attention
# (before the engine handed it to torch's checkpoint: CheckpointError, "Recomputed values ...
# have different metadata"). SGD: under AdamW the first step's grad norm agrees to 1e-7, but
# near-zero lm_head gradients summed in another order grow to 7e-5 in the weights (test_trl.py)
SFT_ARGS = {"completion_only_loss": True, "eval_strategy": "steps", "eval_steps": 2,
            "pad_to_multiple_of": 4, "optim": "sgd", "learning_rate": 0.3}  # fmt: skip
SFT = [
    {"id": "cp-sft", "plugin": LOSS_CP2, "batch": 2, "eval": True, "args": SFT_ARGS},
    # LoRA adapters (PEFT's wrapper names no position_ids but hands them to the base model: the
    # positions it is given under CP must be the global ones)
    slow_case({"id": "cp-sft-lora", "plugin": LOSS_CP2, "batch": 2, "eval": True, "lora": True,
               "args": SFT_ARGS}),
]  # fmt: skip
# TRL's DPO (a loss over pairs of rows: a chosen and a rejected row per pair) at pp 2 x cp 2,
# one pair per process (4 pairs a step, 2 per micro-batch), rows padded to multiples of 2 x cp
# by TRL's collator, evaluated after steps 2 and 3 on 7 pairs (a last batch of 3 pairs, one
# micro-batch), against TRL's DPOTrainer in one process on the 4-pair batch: LoRA adapters with
# TRL's reference (adapters disabled) run each step through the pipeline; (slow) a reference
# model loaded from the policy's path, run each step with its weights swapped into the shards
DPO_ARGS = {"precompute_ref_log_probs": False, "pad_to_multiple_of": 4}
DPO = [
    {"id": "cp-dpo-lora", "plugin": LOSS_CP2, "batch": 1, "eval": True, "eval_pairs": 7,
     "init": {"peft_config": {}}, "args": DPO_ARGS},
    slow_case({"id": "cp-dpo-ref-model", "plugin": LOSS_CP2, "batch": 1, "eval": True,
               "eval_pairs": 7, "from_path": True, "args": DPO_ARGS}),
]  # fmt: skip
# a LightningModule calling an HF Llama with labels= on right-padded rows (its own loss,
# computed on the whole sequences' logits under CP), then validated
HF_LIGHTNING = [
    {"id": "lightning-hf-llama-pp2-cp2",
     "strategy": {"pp_size": 2, "cp_size": 2, "num_microbatches": 2, "split": "call"}},
]  # fmt: skip
TRAINER_ONE = {"per_device_train_batch_size": 8, "per_device_eval_batch_size": 8}
# ZeroPPTrainer: checkpoint-2 of TRAINER's 4 steps (mid-epoch) saved under one cp, resumed under
# the other from other initial weights; trained as TRAINER's case (its evaluation and predict()
# left out: they do not move the training), so its one-process run is the reference
TRAINER_CP2 = TRAINER[0]["plugin"]
TRAINER_CP1 = {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 2, "seq_buckets": 8}
SAVING = {
    "rows": "padded",
    "args": {
        "max_grad_norm": 0.3,
        "gradient_accumulation_steps": 2,
        "save_strategy": "steps",
        "save_steps": 2,
    },
}
TRAINER_ACROSS = [
    {"id": "trainer-resume-cp2-at-cp1", "saved": TRAINER_CP2, "resumed": TRAINER_CP1,
     "script": SAVING},
    slow_case({"id": "trainer-resume-cp1-at-cp2", "saved": TRAINER_CP1, "resumed": TRAINER_CP2,
               "script": SAVING}),
]  # fmt: skip


# run_clm's save_state after 2 updates at pp 2 x cp 2, load_state and the last 2 updates at
# pp 2 x dp_shard 2 (cp 1), and the reverse: the continuation is the uninterrupted run's
CP2 = {"pp_size": 2, "cp_size": 2, "num_microbatches": 2}
CP1 = {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 2}
# (cp 1 resumed at cp 2, both fronts: the slow run)
ACROSS = [
    {"id": "resume-cp2-at-cp1", "args": PAD, "saved": CP2, "resumed": CP1},
    slow_case({"id": "resume-cp1-at-cp2", "args": PAD, "saved": CP1, "resumed": CP2}),
]
# Lightning: a fit stopped by max_steps (epochs of 2 steps: "stop" 1 is mid-epoch 0, 2 its end)
# and trainer.save_checkpoint (a sharded folder) under one cp, fit(ckpt_path=...) under the other
# up to step 4. Mid-epoch, the resumed losses were epoch 1's batches (4.230075 against 4.285345 at
# the first) under every pair of cp sizes, cp 1 to cp 1 too: the checkpoint counted the stopped
# epoch completed. (cp 2 to cp 1 mid-epoch in CI; the rest slow.)
LIGHTNING_ACROSS = [
    {"id": "lightning-resume-mid-epoch-cp2-at-cp1", "saved": CP2, "resumed": CP1, "stop": 1},
    slow_case({"id": "lightning-resume-mid-epoch-cp1-at-cp2", "saved": CP1, "resumed": CP2,
               "stop": 1}),
    slow_case({"id": "lightning-resume-mid-epoch-cp1-at-cp1", "saved": CP1, "resumed": CP1,
               "stop": 1}),
    slow_case({"id": "lightning-resume-mid-epoch-cp2-at-cp2", "saved": CP2, "resumed": CP2,
               "stop": 1}),
    slow_case({"id": "lightning-resume-cp2-at-cp1", "saved": CP2, "resumed": CP1, "stop": 2}),
    slow_case({"id": "lightning-resume-cp1-at-cp2", "saved": CP1, "resumed": CP2, "stop": 2}),
]  # fmt: skip


@pytest.fixture(scope="module")
def launched(request: Any, tmp_path_factory: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    out = tmp_path_factory.mktemp("context_fronts")
    params = {
        "lightning": [dict(c) for c in LIGHTNING],
        "accelerate": [dict(c) for c in ACCELERATE],
        "trainer": [dict(c) for c in TRAINER],
        "hf_lightning": [dict(c) for c in HF_LIGHTNING],
        "across": [dict(c) for c in selected_cases(request, ACROSS)],
        "lightning_across": [dict(c) for c in selected_cases(request, LIGHTNING_ACROSS)],
        "trainer_across": [dict(c) for c in selected_cases(request, TRAINER_ACROSS)],
        "last_loss": [dict(c) for c in selected_cases(request, LAST_LOSS)],
        "trl": [dict(c) for c in selected_cases(request, SFT)],
        "trl_dpo": [dict(c) for c in selected_cases(request, DPO)],
        "out_dir": str(out / "four"),
        "init_process_group": False,
    }
    four = launch(4, "context_front_scenarios.run", params, out / "four", timeout=900)
    refs = [{"id": c["id"], "args": {**c["args"], **ONE}} for c in ACCELERATE]
    trainer_refs = [
        {"id": c["id"], "plugin": None, "script": {**c["script"], **TRAINER_ONE}} for c in TRAINER
    ]
    params = {
        "lightning": [],
        "accelerate": refs,
        "trainer": trainer_refs,
        "hf_lightning": [{"id": c["id"], "strategy": None} for c in HF_LIGHTNING],
        "last_loss": [_one_process(c) for c in selected_cases(request, LAST_LOSS)],
        "trl": [{**c, "plugin": None, "batch": 8} for c in selected_cases(request, SFT)],
        "trl_dpo": [{**c, "plugin": None, "batch": 4} for c in selected_cases(request, DPO)],
        "devices": 1,
        "out_dir": str(out / "one"),
        "init_process_group": False,
    }
    one = launch(1, "context_front_scenarios.run", params, out / "one", timeout=600)
    return four, one[0]


@pytest.fixture(scope="module")
def results(launched: Any) -> list[dict[str, Any]]:
    return launched[0]


@pytest.mark.parametrize("case", ACCELERATE, ids=lambda c: c["id"])
def test_accelerate_run_clm_loop_on_padded_rows_matches_one_process(launched, case):
    four, one = launched
    ref = one[case["id"]]
    for rank, r in enumerate(four):
        got = r[case["id"]]
        assert got["batches"] == ref["batches"]
        _close(got["loss"], ref["loss"], f"rank {rank} losses")
        _close(got["lr"], ref["lr"], f"rank {rank} learning rates")
        _close(got["norm"], ref["norm"], f"rank {rank} clip norms")
        _close(got["eval_loss"], ref["eval_loss"], f"rank {rank} eval loss")
        assert sorted(got["eval_ids"]) == sorted(ref["eval_ids"])  # every sample once
    assert min(ref["norm"]) > 0.5  # clipping active: it guards the gradient scale
    params = four[0][case["id"]]["params"]  # the whole model lands on the main process
    assert params.keys() == ref["params"].keys()
    for name, want in ref["params"].items():
        _close(params[name], want, name)


def _close(got: Any, want: Any, what: str) -> None:
    torch.testing.assert_close(
        torch.as_tensor(got, dtype=torch.float64),
        torch.as_tensor(want, dtype=torch.float64),
        rtol=0,
        atol=1e-5,
        msg=lambda m: f"{what}: {m}",
    )


@pytest.mark.parametrize("case", LIGHTNING, ids=lambda c: c["id"])
def test_lightning_trainer_with_an_unmodified_module_matches_one_process(results, case):
    # Lightning's DistributedSampler shuffles the training rows (seeded by epoch): one
    # permutation split over the data-parallel ranks, read alike by the CP ranks of each.
    ref = reference("adamw", True, 3, batches=sampler_batches(3))
    for rank, r in enumerate(results):
        got = r[case["id"]]
        _close(got["returned"], ref["losses"], f"rank {rank} returned losses")
        _close(got["logged"], ref["losses"], f"rank {rank} logged losses")
    params = merged_params(results, case["id"])
    assert params.keys() == ref["params"].keys()
    for name, want in ref["params"].items():
        _close(params[name], want, name)
    assert max(ref["norms"]) > 0.3  # clipping really scaled the gradients
    val = _val_reference(ref["params"], make_batches(3))
    model = make_model()
    model.load_state_dict(ref["params"])
    with torch.no_grad():  # predict_step's logits: whole sequences, on every rank
        logits = model(make_batches(1)[0][0])
    for rank, r in enumerate(results):
        _close(r[case["id"]]["val_loss"], val, f"rank {rank} validation loss")
        _close(r[case["id"]]["predictions"], logits, f"rank {rank} predictions")


def _val_reference(params: dict[str, torch.Tensor], batches: list[Any]) -> float:
    """The trained model's mean loss over the validation batches (unshuffled), one process."""
    model = make_model()
    model.load_state_dict(params)
    with torch.no_grad():
        losses = [float(lm_loss(model(x), y)) for x, y in batches]
    return sum(losses) / len(losses)


@pytest.mark.parametrize("case", TRAINER, ids=lambda c: c["id"])
def test_zeropp_trainer_on_padded_rows_matches_one_process(launched, case):
    four, one = launched
    ref = one[case["id"]]
    got = four[0][case["id"]]
    steps = [log for log in got["logs"] if "loss" in log]
    want = [log for log in ref["logs"] if "loss" in log]
    assert len(steps) == len(want) == 4
    for a, b in zip(steps, want, strict=True):
        _close(a["loss"], b["loss"], "logged loss")
        _close(a["grad_norm"], b["grad_norm"], "grad norm")
        _close(a["learning_rate"], b["learning_rate"], "learning rate")
    assert min(b["grad_norm"] for b in want) > 0.3  # clipping acts
    evals = [log for log in got["logs"] if "eval_loss" in log]
    want_evals = [log for log in ref["logs"] if "eval_loss" in log]
    assert len(evals) == len(want_evals) == 2  # steps 2 and 4
    for a, b in zip(evals, want_evals, strict=True):
        _close(a["eval_loss"], b["eval_loss"], "eval loss")
        # from the logits gathered back into whole sequences, in DDP's process order
        _close(a["eval_accuracy"], b["eval_accuracy"], "eval token accuracy")
    _close(got["predict_metrics"]["test_loss"], ref["predict_metrics"]["test_loss"], "predict")
    # predict()'s logits: whole sequences in order, every row once, at each row's real tokens
    # (the padding to buckets differs from one process's padding to the longest row)
    from tests.distributed.trainer_script import texts

    rows = texts(16, 2, False)  # the script's evaluation rows
    assert len(got["predictions"]) == len(ref["predictions"]) == len(rows)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        _close(got["predictions"][i, :n], ref["predictions"][i, :n], f"predictions row {i}")
    assert got["weights"].keys() == ref["weights"].keys()
    for name, value in ref["weights"].items():
        _close(got["weights"][name], value, name)


@pytest.mark.parametrize("case", HF_LIGHTNING, ids=lambda c: c["id"])
def test_lightning_module_with_an_hf_llama_on_padded_rows_matches_one_process(launched, case):
    four, one = launched
    ref = one[case["id"]]
    for rank, r in enumerate(four):
        _close(r[case["id"]]["losses"], ref["losses"], f"rank {rank} logged losses")
        _close(r[case["id"]]["val_loss"], ref["val_loss"], f"rank {rank} validation loss")
    params = four[0][case["id"]]["params"]
    assert params.keys() == ref["params"].keys()
    for name, want in ref["params"].items():
        _close(params[name], want, name)


@pytest.mark.parametrize("case", ACROSS, ids=[case_of(c)["id"] for c in ACROSS])
def test_a_checkpoint_resumes_under_another_cp_size(launched, case):
    four, one = launched
    ref = one[ACCELERATE[0]["id"]]  # the same loop and rows, uninterrupted, in one process
    for rank, r in enumerate(four):
        _close(r[case["id"]]["loss"], ref["loss"][2:], f"rank {rank} resumed losses")
    params = four[0][case["id"]]["params"]
    for name, want in ref["params"].items():
        _close(params[name], want, name)


@pytest.mark.parametrize("case", LIGHTNING_ACROSS, ids=[case_of(c)["id"] for c in LIGHTNING_ACROSS])
def test_a_lightning_checkpoint_resumes_under_another_cp_size(results, case):
    ref = reference(
        "adamw", True, 4, batches=sampler_batches(2, epochs=2)
    )  # uninterrupted, one process
    for rank, r in enumerate(results):
        got = r[case["id"]]["logged"]
        _close(got, ref["losses"][case["stop"] :], f"rank {rank} resumed losses")
    params = merged_params(results, case["id"])
    assert params.keys() == ref["params"].keys()
    for name, want in ref["params"].items():
        _close(params[name], want, name)


@pytest.mark.parametrize("case", TRAINER_ACROSS, ids=[case_of(c)["id"] for c in TRAINER_ACROSS])
def test_a_zeropp_trainer_checkpoint_resumes_under_another_cp_size(launched, case):
    four, one = launched
    ref = one[TRAINER[0]["id"]]  # the same training, uninterrupted, in one process
    got = four[0][case["id"]]
    steps = [log for log in got["logs"] if "loss" in log]
    want = [log for log in ref["logs"] if "loss" in log][2:]
    assert len(steps) == len(want) == 2  # steps 3 and 4, after checkpoint-2
    for a, b in zip(steps, want, strict=True):
        _close(a["loss"], b["loss"], "resumed logged loss")
        _close(a["grad_norm"], b["grad_norm"], "resumed grad norm")
        _close(a["learning_rate"], b["learning_rate"], "resumed learning rate")
    assert got["weights"].keys() == ref["weights"].keys()
    for name, value in ref["weights"].items():
        _close(got["weights"][name], value, name)


LOOPS = [c for c in LAST_LOSS if "loop" in case_of(c)]


@pytest.mark.parametrize("case", as_params(LOOPS))
def test_an_accelerate_loop_with_its_own_loss_under_cp_matches_one_process(launched, case):
    four, one = launched
    case = case["id"]
    ref = one[case]
    assert len(ref["logs"]) == 3
    for rank, r in enumerate(four):  # loss and metric, the same on every rank
        got = r[case]
        assert len(got["logs"]) == 3
        for a, b in zip(got["logs"], ref["logs"], strict=True):
            assert a.keys() == b.keys() == {"loss", "accuracy"}
            _close(a["loss"], b["loss"], f"rank {rank} loss")
            _close(a["accuracy"], b["accuracy"], f"rank {rank} accuracy")
        _close(got["eval_loss"], ref["eval_loss"], f"rank {rank} eval loss")
    weights = four[0][case]["weights"]
    assert weights.keys() == ref["weights"].keys()
    for name, want in ref["weights"].items():
        _close(weights[name], want, name)


@pytest.mark.parametrize("case", as_params([c for c in LAST_LOSS if c not in LOOPS]))
def test_the_trainers_own_loss_under_cp_matches_one_process(launched, case):
    four, one = launched
    case = case["id"]
    ref = one[case]
    for rank, r in enumerate(four):  # every rank logs the numbers
        got = r[case]
        steps = [log for log in got["logs"] if "loss" in log]
        want = [log for log in ref["logs"] if "loss" in log]
        assert len(steps) == len(want) == 4
        for a, b in zip(steps, want, strict=True):
            _close(a["loss"], b["loss"], f"rank {rank} logged loss")
            _close(a["grad_norm"], b["grad_norm"], f"rank {rank} grad norm")
        evals = [log["eval_loss"] for log in got["logs"] if "eval_loss" in log]
        want_evals = [log["eval_loss"] for log in ref["logs"] if "eval_loss" in log]
        assert len(evals) == len(want_evals) == 2
        _close(evals, want_evals, f"rank {rank} eval loss")
    weights = four[0][case]["weights"]
    assert weights.keys() == ref["weights"].keys()
    for name, want in ref["weights"].items():
        _close(weights[name], want, name)


@pytest.mark.parametrize("case", as_params(SFT))
def test_trl_sft_under_cp_matches_trl_in_one_process(launched, case):
    four, one = launched
    case = case["id"]
    ref = one[case]
    metrics = ("loss", "entropy", "mean_token_accuracy", "grad_norm")
    evaluated = ("eval_loss", "eval_entropy", "eval_mean_token_accuracy")
    for rank, r in enumerate(four):  # every rank logs the numbers
        for keys, want_n in ((metrics, 3), (evaluated, 2)):
            got = [log for log in r[case]["logs"] if keys[0] in log]
            want = [log for log in ref["logs"] if keys[0] in log]
            assert len(got) == len(want) == want_n
            for a, b in zip(got, want, strict=True):
                for key in keys:
                    _close(a[key], b[key], f"rank {rank} {key}")
                tokens = "num_tokens" if keys is metrics else "eval_num_tokens"
                assert a[tokens] == b[tokens]
    weights = four[0][case]["weights"]
    assert weights.keys() == ref["weights"].keys()
    for name, want in ref["weights"].items():
        _close(weights[name], want, name)


@pytest.mark.parametrize("case", as_params(DPO))
def test_trl_dpo_under_cp_matches_trl_in_one_process(launched, case):
    from tests.distributed.test_trl_dpo import check_equal

    four, one = launched
    name = case["id"]
    # loss, grad norm and TRL's metrics per step on every rank, eval_* after steps 2 and 3,
    # num_tokens equal, the saved weights (the adapters under LoRA)
    check_equal(four[0][name], one[name], [rank[name] for rank in four])
