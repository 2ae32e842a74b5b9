"""A `transformers.Trainer` script (tests/distributed/trainer_script.py) under `ZeroPPTrainer`
matches the same script under the plain Trainer with DDP on the same 4 gloo ranks (equal-length
rows), and one process (padded, LoRA and packed rows): loss, gradient norm and learning rate per
logged step, evaluation, predictions, and the weights `save_model` writes (read back with
`from_pretrained`). A run resumed from a mid-epoch checkpoint continues as the uninterrupted one.
One launch of 4 ranks runs every case; one launch of 1 rank runs the references.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tests.distributed.conftest import selected_cases, slow_case
from tests.distributed.launch import launch
from tests.distributed.trainer_scenarios import initial_weights
from tests.distributed.trainer_script import texts

pytestmark = pytest.mark.distributed

PP = {"pp_size": 2, "num_microbatches": 2}
CLIPPED = {"max_grad_norm": 0.3, "gradient_accumulation_steps": 2}
EVAL = {"eval_strategy": "steps", "eval_steps": 2, "lr_scheduler_type": "cosine", "warmup_steps": 1}
LORA = {"lora": True, "rows": "padded"}
# tokens seen counted as one process counts them, padding included (before: 400 against 448)
SEEN = {"include_num_input_tokens_seen": True}
# Qwen2-MoE: a mixture of experts with a shared expert (router logits off, the config's default)
# at pp 2 x dp 2, padded rows; before, save_model crashed in gloo ("64 vs 32" bytes: the
# (1, hidden) shared_expert_gate shards empty on the second data-parallel rank). Not with BEST:
# the plain Trainer's load_best_model_at_end skips its experts (transformers 5.24 saves them per
# expert and loads that file with strict=False), so one process's reference would be wrong.
QWEN2_MOE = {
    "family": "qwen2_moe",
    "config": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
    },
    "rows": "padded",
    "args": CLIPPED,
}
# packed rows regrouped into 3 micro-batches: in evaluation a packed row does not split into the
# 2 processes' shares (each process reports the global batch's mean); 10 evaluation rows, 12 a
# batch: Accelerate repeats 2 documents to complete the last batch, which must not count (before:
# eval_loss 4.811245 against 4.818483)
PACKED = {
    "rows": "packed",
    "per_device_train_batch_size": 3,
    "per_device_eval_batch_size": 3,
    "eval_rows": 10,
    "predict": True,  # the packed logits, gathered: each pipeline's row once
    "args": {
        "optim": "sgd",
        "learning_rate": 0.5,
        "max_grad_norm": 0,
        "eval_strategy": "steps",
        "eval_steps": 2,
        **SEEN,  # packed rows: no padding, the ranks' counts add up
    },
}
# the best checkpoint by a metric that is not the last step's (the higher loss), loaded at the
# end; the Trainer's rotation (save_total_limit=1) keeps it alone
BEST = {
    "eval_strategy": "steps",
    "eval_steps": 2,
    "save_strategy": "steps",
    "save_steps": 2,
    "load_best_model_at_end": True,
    "metric_for_best_model": "eval_loss",
    "greater_is_better": True,
    "save_total_limit": 1,
}
# torch's fused AdamW on the sharded parameters (TrainingArguments' tested optims)
PADDED = {"rows": "padded", "args": {**CLIPPED, **BEST, "optim": "adamw_torch_fused"}}
# GPT-2: tied embeddings, learned positions; dropout off (the runs draw other random numbers)
GPT2 = {
    "family": "gpt2",
    "tie_word_embeddings": None,
    "config": {"n_positions": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
}
# BERT-MLM's forward returns its own mean cross-entropy (it ignores num_items_in_batch): the
# pipeline rescales each micro-batch's mean to its token sum over the batch's count. A fixed mask
# (trainer_script.masked) over padded rows: micro-batches hold different numbers of masked tokens
BERT = {"family": "bert", "rows": "padded", "args": {**EVAL, **SEEN, "optim": "rmsprop"}}
BERT_ACCUM = {
    **BERT,
    "args": {"optim": "sgd", "learning_rate": 0.5, "gradient_accumulation_steps": 2},
}
PP1 = {"rows": "padded", "args": {**CLIPPED, **EVAL}}
PP1_LAYOUT = {"pp_size": 1, "dp_shard_size": 2, "dp_replicate_size": 2}
CASES = [
    # equal rows: the plain Trainer's DDP is exact there, and runs in the same launch.
    # evaluate() before train() here, eval_on_start there: the plain Trainer under DDP trains
    # without DDP after an evaluate() (its ranks drift apart: transformers 5.24).
    {
        "id": "equal",
        "plugin": PP,
        "save_pretrained": True,  # refused on every rank at pp_size=2 too
        "script": {**GPT2, "evaluate_first": True, "predict": True, "args": {**CLIPPED, **EVAL}},
    },
    {
        "id": "equal-ddp",
        "plugin": None,
        "script": {**GPT2, "predict": True, "args": {**CLIPPED, **EVAL, "eval_on_start": True}},
    },
    # padded rows against one process; lengths padded to multiples of 8 (two schedules)
    {
        "id": "padded",
        "plugin": {**PP, "schedule": "zeropp", "num_microbatches": 4, "seq_buckets": 8},
        "script": PADDED,
    },
    # the head and HF's loss in chunks of 3 tokens on the last stage (`fronts.hf_chunked`)
    {"id": "lora", "plugin": {**PP, "loss_chunk": 3}, "script": LORA},
    {"id": "bert", "plugin": PP, "script": BERT},
    # the same model accumulating 2 batches per update: each micro-batch's mean rescaled to a
    # sum over the whole window's count (the Trainer's num_items_in_batch)
    # (the run_clm loop accumulates BERT's own mean in CI: test_clm_loop.py's bert-acc2)
    slow_case({"id": "bert-accum", "plugin": PP, "script": BERT_ACCUM}),
    # (mixtures of experts in CI: test_moe.py)
    slow_case({"id": "qwen2-moe", "plugin": PP, "script": QWEN2_MOE}),
    # one stage (pure sharded data parallelism, 2 shards x 2 replicas): the stage is the model
    # passed in, sharded in place. Before: "FSDP parameters should be materialized from meta
    # device ... [None, None, None]" (the Trainer released that model's weights to meta)
    # `model.save_pretrained(dir)` instead of `trainer.save_model(dir)`: refused on every rank.
    # Before: rank 0 raised "invalid python storage" while rank 1 wrote its own shard.
    {"id": "pp1", "plugin": PP1_LAYOUT, "script": PP1, "save_pretrained": True},
    {
        "id": "packed",
        "plugin": {"pp_size": 2, "num_microbatches": 3},
        "script": PACKED,
        "one": {"per_device_train_batch_size": 12, "per_device_eval_batch_size": 12},
    },
    # checkpoints at steps 2 and 4 of a shuffled epoch of 8 steps; a fresh run from other
    # initial weights resumes from checkpoint-2
    {
        "id": "resume",
        "env": {"ZEROPP_PP_SIZE": "2", "ZEROPP_NUM_MICROBATCHES": "2"},  # no zeropp_plugin
        "script": {"args": {"save_strategy": "steps", "save_steps": 2}},
        "resume": {"init_seed": 7},
        # checkpoint-2 resumed with twice its global batch: refused, naming the rows
        "other": {"per_device_train_batch_size": 4},
    },
]
# one process reads the 4 processes' per-device batches at once
ONE = {"per_device_train_batch_size": 8, "per_device_eval_batch_size": 8}
AGAINST_ONE = ("padded", "lora", "packed", "bert", "bert-accum", "qwen2-moe", "pp1")


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer")
    cases = selected_cases(request, CASES)
    references = [
        {"id": case["id"], "plugin": None, "script": {**case["script"], **case.get("one", ONE)}}
        for case in cases
        if case["id"] in AGAINST_ONE
    ]
    four = launch(
        4,
        "trainer_scenarios.run",
        {"cases": cases, "out_dir": str(out / "four")},
        out / "four",
        timeout=600,
    )
    one = launch(
        1,
        "trainer_scenarios.run",
        {"cases": references, "out_dir": str(out / "one")},
        out / "one",
        timeout=600,
    )
    return four, one[0]


def _steps(logs: list[dict]) -> list[dict]:
    return [log for log in logs if "loss" in log]


def _assert_same_training(got: dict, ref: dict, atol: float = 1e-5) -> None:
    steps, ref_steps = _steps(got["logs"]), _steps(ref["logs"])
    assert len(steps) == len(ref_steps) == 4 and got["steps"] == ref["steps"] == 4
    for a, b in zip(steps, ref_steps, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=atol)
        assert a["learning_rate"] == pytest.approx(b["learning_rate"], abs=1e-9)
        if "grad_norm" in b:
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5, abs=1e-5)
        assert a.get("num_input_tokens_seen") == b.get("num_input_tokens_seen")


def _assert_same_weights(got: dict, ref: dict, key: str = "weights") -> None:
    assert got[key].keys() == ref[key].keys()
    for name, value in ref[key].items():
        torch.testing.assert_close(got[key][name], value, rtol=0, atol=1e-5, msg=name)


def test_equal_rows_match_ddp(runs):
    four, _ = runs
    got, ddp = four[0]["equal"], four[0]["equal-ddp"]
    _assert_same_training(got, ddp)
    assert min(s["grad_norm"] for s in _steps(ddp["logs"])) > CLIPPED["max_grad_norm"], (
        "clipping must act"
    )
    for rank in four:  # every rank logs the same numbers (rank 0's reach the loggers)
        assert _steps(rank["equal"]["logs"]) == _steps(got["logs"])
    evals = [log for log in got["logs"] if "eval_loss" in log]
    ddp_evals = [log for log in ddp["logs"] if "eval_loss" in log]
    assert len(evals) == len(ddp_evals) == 3  # evaluate() before training, steps 2 and 4
    for a, b in zip(evals, ddp_evals, strict=True):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], abs=1e-5)
        assert a["eval_accuracy"] == pytest.approx(b["eval_accuracy"], abs=1e-9)
    np.testing.assert_allclose(got["predictions"], ddp["predictions"], atol=1e-5, rtol=0)
    assert got["predict_metrics"]["test_loss"] == pytest.approx(
        ddp["predict_metrics"]["test_loss"], abs=1e-5
    )
    _assert_same_weights(got, ddp)


def test_padded_rows_match_one_process(runs):
    four, one = runs
    got = four[0]["padded"]
    _assert_same_training(got, one["padded"])
    _assert_same_weights(got, one["padded"])  # the best checkpoint's, loaded at the end
    assert got["best"] == one["padded"]["best"] == "checkpoint-2"
    assert got["checkpoints"] == one["padded"]["checkpoints"] == ["checkpoint-2"]
    # the Trainer's evaluation loss: each process's token sum over the global batch's tokens
    # (times the processes), so its mean is the global batch's token mean, as one process's
    evals = [log for log in got["logs"] if "eval_loss" in log]
    want = [log for log in one["padded"]["logs"] if "eval_loss" in log]
    assert len(evals) == len(want) == 2  # steps 2 and 4
    for a, b in zip(evals, want, strict=True):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], abs=1e-5)
        assert a["eval_accuracy"] == pytest.approx(b["eval_accuracy"], abs=1e-9)
    # lengths 3..12 padded to 8 or 16: two training shapes, built once each, plus evaluation
    assert got["planning"]["schedule_evictions"] == 0
    assert got["planning"]["schedules_built"] <= 4


def test_lora_trains_adapters_as_one_process(runs):
    four, one = runs
    got, ref = four[0]["lora"], one["lora"]
    _assert_same_training(got, ref)
    assert got["files"] == ref["files"] and "adapter_model.safetensors" in got["files"]
    _assert_same_weights(got, ref, "adapter")
    _assert_same_weights(got, ref, "merged")  # merge_and_unload, exported and read back
    start = initial_weights(LORA)
    base = [n for n in start if "lora_" not in n]
    for name in base:  # frozen: exactly as loaded
        torch.testing.assert_close(got["whole"][name], start[name], rtol=0, atol=0, msg=name)
    moved = [n for n in start if "lora_" in n and not torch.equal(got["whole"][n], start[n])]
    assert moved, "the adapters must train"
    for rank in four:  # optimizer state for adapters only, on every rank
        facts = rank["lora"]
        assert facts["with_state"] and all("lora_" in n for n in facts["with_state"])
        assert facts["frozen"] and all("lora_" not in n for n in facts["frozen"])


def test_packed_rows_match_one_process(runs):
    four, one = runs
    _assert_same_training(four[0]["packed"], one["packed"])
    _assert_same_weights(four[0]["packed"], one["packed"])
    evals = [log["eval_loss"] for log in four[0]["packed"]["logs"] if "eval_loss" in log]
    want = [log["eval_loss"] for log in one["packed"]["logs"] if "eval_loss" in log]
    assert len(evals) == len(want) == 2
    assert evals == pytest.approx(want, abs=1e-5)
    # predict(): one packed row per data-parallel rank (before: each twice, once per process of
    # its pipeline); rank 0's 6 documents, then rank 1's 4 (and the 2 Accelerate repeated to
    # complete the batch), against one process's row of the 10
    got, ref = four[0]["packed"]["predictions"], one["packed"]["predictions"]
    assert got.shape[0] == 2 and ref.shape[0] == 1
    lengths = [len(row["input_ids"]) for row in texts(PACKED["eval_rows"], 2, equal=False)]
    first, total = sum(lengths[:6]), sum(lengths)
    flat = np.concatenate([got[0, :first], got[1, : total - first]])
    np.testing.assert_allclose(flat, ref[0, :total], atol=1e-5, rtol=0)


def test_masked_lm_computing_its_own_mean_matches_one_process(runs):
    """Before: the mean of micro-batch means (first step 4.8714 against 4.8498) and an eval loss
    times the processes (19.51 against 4.86)."""
    four, one = runs
    got, ref = four[0]["bert"], one["bert"]
    _assert_same_training(got, ref)
    _assert_same_weights(got, ref)
    evals = [log["eval_loss"] for log in got["logs"] if "eval_loss" in log]
    want = [log["eval_loss"] for log in ref["logs"] if "eval_loss" in log]
    assert len(evals) == len(want) == 2
    assert evals == pytest.approx(want, abs=1e-5)


@pytest.mark.slow
@pytest.mark.cases("bert-accum")
def test_masked_lm_accumulating_two_batches_matches_one_process(runs):
    four, one = runs
    got, ref = four[0]["bert-accum"], one["bert-accum"]
    assert len(_steps(got["logs"])) == len(_steps(ref["logs"])) == 4
    _assert_same_training(got, ref)
    _assert_same_weights(got, ref)


def test_a_resume_with_another_global_batch_is_refused_naming_the_rows(runs):
    """checkpoint-2 of 8-row steps (4 processes x 2 rows), resumed at 16 rows a step. Before:
    the Trainer skipped 2 steps of 16 rows (16 never trained) without a word."""
    four, _ = runs
    for rank in four:
        assert re.fullmatch(
            r"this run resumes from .*checkpoint-2 after 2 optimizer steps, saved with a global "
            r"batch of 8 rows \(16 rows trained\); this run's global batch is 16 rows, so "
            r"skipping 2 steps would skip 32 rows, 16 of them never trained\. Resume with the "
            r"checkpoint's global batch .*ignore_data_skip=True.*",
            rank["resume"]["other"] or "",
        ), rank["resume"]["other"]


@pytest.mark.slow
@pytest.mark.cases("qwen2-moe")
def test_mixture_of_experts_matches_one_process(runs):
    """Qwen2-MoE through ZeroPPTrainer: losses, norms and the weights save_model writes. Before:
    save_model's gather ended in gloo's "64 vs 32" bytes on the second data-parallel rank."""
    four, one = runs
    _assert_same_training(four[0]["qwen2-moe"], one["qwen2-moe"])
    _assert_same_weights(four[0]["qwen2-moe"], one["qwen2-moe"])


def test_one_stage_matches_one_process(runs):
    """pp_size=1 under ZeroPPTrainer: losses, norms, evaluation and the saved weights."""
    four, one = runs
    got, ref = four[0]["pp1"], one["pp1"]
    assert got["layout"]["pp_size"] == 1
    _assert_same_training(got, ref)
    _assert_same_weights(got, ref)
    evals = [log["eval_loss"] for log in got["logs"] if "eval_loss" in log]
    want = [log["eval_loss"] for log in ref["logs"] if "eval_loss" in log]
    assert len(evals) == len(want) == 2
    assert evals == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("case_id", ["pp1", "equal"])
def test_the_models_own_save_pretrained_is_refused_on_every_rank(runs, case_id):
    """`model.save_pretrained(dir)` after training, at pp_size 1 (the model is the one stage,
    sharded in place) and 2 (its weights moved into the stages): refused on every rank, naming
    `trainer.save_model(dir)`, and no weights written."""
    four, _ = runs
    for rank in four:
        got = rank[case_id]["save_pretrained"]
        assert "trainer.save_model(dir)" in (got["error"] or ""), got["error"]
        assert not [f for f in got["files"] if "safetensors" in f or f.endswith(".bin")]
    assert "pp_size=1" in four[0]["pp1"]["save_pretrained"]["error"]


def test_a_resume_from_a_checkpoint_with_planted_code_runs_nothing(runs):
    # zeropp/meta.pt replaced by a pickle that creates a file, its checksums rewritten: before,
    # the code ran on every rank, which then printed that the file was refused.
    four, _ = runs
    for rank in four:
        planted = rank["resume"]["planted"]
        assert not planted["code_ran"]
        assert re.search(r"checkpoint-planted/zeropp/meta.pt names io.open", planted["error"] or "")


def test_resume_mid_epoch_continues(runs):
    four, _ = runs
    full, resumed = four[0]["resume"], four[0]["resume"]["resumed"]
    # the layout came from ZEROPP_* variables: two stages, two micro-batches
    assert full["layout"] == resumed["layout"] == {"pp_size": 2, "num_microbatches": 2}
    full_steps = _steps(full["logs"])
    again = _steps(resumed["logs"])
    assert [s["step"] for s in again] == [3, 4] if "step" in again[0] else len(again) == 2
    for a, b in zip(again, full_steps[2:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["learning_rate"] == pytest.approx(b["learning_rate"], abs=1e-9)
    _assert_same_weights(resumed, full)


# Over the suite's time budget: bench/slow_tests.py runs them.
SLOW_CASES = [
    # bf16=True is FSDP2 mixed precision (bf16 compute, fp32 reduction), not autocast
    {"id": "bf16", "plugin": PP, "script": {**GPT2, "args": {**CLIPPED, **EVAL, "bf16": True}}},
    # a streamed training set (IterableDataset), against DDP
    {"id": "stream", "plugin": PP, "script": {"iterable": True, "args": CLIPPED}},
    {"id": "stream-ddp", "plugin": None, "script": {"iterable": True, "args": CLIPPED}},
    # padded rows without buckets: a schedule per length seen, the same numbers
    {
        "id": "padded-exact",
        "plugin": {**PP, "schedule": "zeropp", "num_microbatches": 4},
        "script": PADDED,
    },
]


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer_slow")
    params = {"cases": SLOW_CASES, "out_dir": str(out)}
    return launch(4, "trainer_scenarios.run", params, out, timeout=600)


@pytest.mark.slow
def test_bf16_trains_in_fsdp_mixed_precision(slow_runs, runs):
    got, fp32 = slow_runs[0]["bf16"], runs[0][0]["equal"]
    assert got["param_dtype"] == "torch.bfloat16"
    steps, ref = _steps(got["logs"]), _steps(fp32["logs"])
    assert len(steps) == len(ref) == 4
    gaps = [abs(a["loss"] - b["loss"]) for a, b in zip(steps, ref, strict=True)]
    assert max(gaps) < 0.05, gaps  # close to fp32 ...
    assert max(gaps) > 1e-6, gaps  # ... but computed in bf16


@pytest.mark.slow
def test_padded_rows_without_buckets(slow_runs, runs):
    """Exact shapes: the same numbers as one process, more schedules than with buckets."""
    got, one = slow_runs[0]["padded-exact"], runs[1]["padded"]
    _assert_same_training(got, one)
    _assert_same_weights(got, one)
    bucketed = runs[0][0]["padded"]["planning"]["schedules_built"]
    assert got["planning"]["schedules_built"] > bucketed


@pytest.mark.slow
def test_streamed_rows_match_ddp(slow_runs):
    got, ddp = slow_runs[0]["stream"], slow_runs[0]["stream-ddp"]
    _assert_same_training(got, ddp)
    _assert_same_weights(got, ddp)
