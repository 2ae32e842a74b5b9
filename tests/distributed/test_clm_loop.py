"""A run_clm-shaped HF loop (tests/distributed/clm_loop.py) under `ZeroPPAccelerator` matches one
process: loss per update, learning rate, clip norm (clipping active), eval loss and every
parameter, with padded batches and an attention mask; the same loop under DDP gives the same
learning rates. The loop is unchanged between runs but for the accelerator's construction.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.conftest import case_of, selected_cases, slow_case
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

PP = {"pp_size": 2, "num_microbatches": 2}
PP4 = {"pp_size": 4, "num_microbatches": 4}
# one process trains on the 4 processes' per-device batches (2 rows each) at once: 8 rows;
# it evaluates per-device batches of 2, as each DDP process does: run_clm's eval loss is the mean
# of per-process losses (a sample's value is its process's batch loss), under DDP and ZeroPP
ONE = {"per_device_train_batch_size": 8, "per_device_eval_batch_size": 2}
CASES = [
    # the head and HF's loss in chunks of 5 tokens on the last stage (`fronts.hf_chunked`)
    {"id": "llama-1f1b", "plugin": {**PP, "loss_chunk": 5}},
    # a forward returning its own mean F.cross_entropy: rescaled to the batch's token weighting
    {"id": "own-loss", "plugin": PP, "args": {"family": "llama_own_loss"}},
    # tied, clipped (the norm counts the tied weight once) and accumulated
    {
        "id": "llama-tied-acc2",
        "plugin": PP,
        "args": {"gradient_accumulation_steps": 2, "tie_word_embeddings": True},
        "tied_gap": True,
    },
    # a masked LM computing its own mean cross-entropy, accumulating 2 batches per update: each
    # micro-batch's mean is rescaled to its share of the accumulation window's token mean
    {"id": "bert-acc2", "plugin": PP, "args": {"family": "bert", "gradient_accumulation_steps": 2}},
    # ZeroPP splits backward: the chunked loss's input task computes the head's weight gradient
    # too, and its held-back weight task finds the weights released (`core.step.chunked_loss`)
    {"id": "llama-zeropp", "plugin": {**PP, "schedule": "ZeroPP", "loss_chunk": 5}},
    slow_case({"id": "pp4", "plugin": {"pp_size": 4, "num_microbatches": 4}}),
    # built under init_empty_weights(); each rank reads its shards of the initial weights from
    # an HF directory (the same weights the one-process run builds)
    {
        "id": "llama-empty-load-from-hf-dir",
        "plugin": {**PP, "dp_shard_size": 2, "num_microbatches": 2, "load_from": "<initial>"},
        "args": {"empty_init": True},
    },
    # PEFT LoRA adapters (init_lora_weights=False) on the attention and MLP projections
    {"id": "llama-lora", "plugin": PP, "args": {"lora": True, "max_grad_norm": 0.3}},
    slow_case(
        {
            "id": "llama-empty-load-zeropp",
            "plugin": {**PP, "schedule": "ZeroPP", "load_from": "<initial>"},
            "args": {"empty_init": True},
        }
    ),
]
# The family sweep: run_clm without clipping (a wrong gradient scale would show), a short last
# eval batch (10 rows, 8 per step), each tied weight's copies compared after every update (they
# must be bit-identical), and the tied models exported (save_pretrained, save_model).
SWEEP = {"max_grad_norm": None, "eval_rows": 10}
EXPORTS = {"export_to": "<out>/pretrained", "save_model_to": "<out>/save_model"}


def _sweep(family: str, tied: bool, **extra) -> dict:
    args = {**SWEEP, "family": family, "tie_word_embeddings": tied, **extra.pop("args", {})}
    return {"id": f"sweep-{family}{'-tied' if tied else ''}", "plugin": PP, "args": args,
            "tied_gap": True, **extra}  # fmt: skip


SWEEP_CASES = [
    _sweep("llama", True, args=EXPORTS),
    _sweep("gpt2", True, args=EXPORTS),  # learned positions; its loss_type is None
    # scaled embedding, soft-capping, masks alternating by layer
    slow_case(_sweep("gemma2", True)),
    slow_case(_sweep("opt", True)),  # learned positions offset by 2, a projection-free OPT
    # mixture of experts at pp 2 x dp 2 (router logits off: see ROUTER): its (1, hidden)
    # shared_expert_gate shards empty on the second data-parallel rank, whose empty shards all
    # sit at address 0; the export took them for one tied tensor and its all-gathers no longer
    # lined up (gloo: "64 vs 32" bytes) (`core.weights.export._first_names`)
    slow_case(_sweep("qwen2_moe", False)),
    # no training: run_clm's eval alone, compared with DDP's and one process's
    {"id": "eval-only", "plugin": PP, "args": {"num_train_epochs": 0, "eval_rows": 10}},
]
# A forward that computes its own mean loss by hand: no count can be seen, so it is refused at its
# first step, on every rank (`fronts.loss_rule.LossWatch`). One computing it as a mean
# F.cross_entropy is weighed exactly (CASES: "own-loss").
REFUSED = {
    "id": "manual-loss",
    "plugin": PP,
    "args": {"family": "llama_manual_loss"},
    "catch": True,
}
# HF's MoE load-balancing loss reads every layer's router logits after the last layer: refused at
# setup on every rank, naming output_router_logits (`core.split.tags`).
ROUTER = {"id": "moe-router", "plugin": PP, "args": {"family": "olmoe+router"}, "catch": True}
# The other families, and the tied model under the other schedules: left to bench/slow_tests.py
# for time (bench/bench_families.py tabulates every family on both fronts).
FAMILY_CASES = [
    *(_sweep(f, False) for f in ("llama", "qwen2", "mistral", "phi3", "gpt_neox")),
    # mixture-of-experts families (router logits off: see ROUTER) in one pipeline of 4 stages
    # (Qwen2-MoE at pp 2 x dp 2: SWEEP_CASES), and OLMoE at pp 2 x dp 2
    *({**_sweep(f, False), "plugin": PP4, "id": f"sweep-{f}-pp4"} for f in ("qwen2_moe", "olmoe")),
    _sweep("olmoe", False),
    _sweep("gemma", True),
    *(
        {**_sweep("llama", True), "id": f"sweep-llama-tied-{schedule}",
         "plugin": {**PP, "schedule": schedule}}
        for schedule in ("interleaved_1f1b", "zbv")
    ),
]  # fmt: skip


def _reference_args(case: dict) -> dict:
    """One process builds the whole model (an empty build is the pipeline's business)."""
    skip = ("empty_init", "export_to", "save_model_to")  # exports are the pipeline's to check
    args = {k: v for k, v in case.get("args", {}).items() if k not in skip}
    return {**args, **ONE}


def _reference_cases(cases: list[dict]) -> list[dict]:
    seen, out = set(), []
    for case in cases:
        if case.get("catch"):
            continue  # refused: nothing to compare
        args = _reference_args(case)
        key = tuple(sorted(args.items()))
        if key not in seen:
            seen.add(key)
            out.append({"id": str(key), "args": args})
    return out


def _ref_id(case: dict) -> str:
    return str(tuple(sorted(_reference_args(case).items())))


def _launch(out: Path, cases: list[dict]) -> tuple[list[dict], dict]:
    """The cases on 4 ranks, and their one-process references."""
    params = {"cases": cases, "init_process_group": False}
    pipe = launch(4, "clm_scenarios.run", params, out / "pp", timeout=600)
    params = {"cases": _reference_cases(cases), "init_process_group": False}
    one = launch(1, "clm_scenarios.run", params, out / "one", timeout=600)
    return pipe, one[0]


def _with_initial_weights(cases: list[dict], out: Path) -> list[dict]:
    """Write the loop's initial model as an HF directory for the cases that load from it; give
    each case's exports a folder of its own."""
    from tests.distributed.clm_loop import Args, build_model

    build_model(Args()).save_pretrained(out / "initial")
    cases = [
        {**c, "plugin": {**c["plugin"], "load_from": str(out / "initial")}}
        if c.get("plugin", {}).get("load_from") == "<initial>"
        else c
        for c in cases
    ]
    return [_outputs_in(c, out) for c in cases]


def _outputs_in(case: dict, out: Path) -> dict:
    args = {
        k: v.replace("<out>", str(out / case["id"])) if isinstance(v, str) else v
        for k, v in case.get("args", {}).items()
    }
    return {**case, "args": args}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("clm")
    cases = [*selected_cases(request, CASES + SWEEP_CASES), ROUTER, REFUSED]
    pipe, one = _launch(out, _with_initial_weights(cases, out))
    ddp_cases = [{"id": "ddp"}, {"id": "ddp-eval", "args": case_of(SWEEP_CASES[-1])["args"]}]
    ddp = launch(
        4, "clm_scenarios.run", {"cases": ddp_cases, "init_process_group": False}, out / "ddp"
    )
    return pipe, one, ddp, out


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("clm_families"), FAMILY_CASES)


def _assert_matches(pipe: list[dict], one: dict, case: dict) -> None:
    ref = one[_ref_id(case)]
    clip = _reference_args(case).get("max_grad_norm", 0.5)
    for rank_result in pipe:  # every rank reports the same values
        got = rank_result[case["id"]]
        assert got["batches"] == ref["batches"]
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=0, atol=1e-5)
        torch.testing.assert_close(got["lr"], ref["lr"], rtol=0, atol=1e-9)
        torch.testing.assert_close(got["norm"], ref["norm"], rtol=1e-5, atol=1e-5)
        if clip is not None and ref["loss"]:
            assert min(ref["norm"]) > clip, "the loop's clipping must be active to guard the scale"
        torch.testing.assert_close(got["eval_loss"], ref["eval_loss"], rtol=0, atol=1e-5)
        torch.testing.assert_close(got["perplexity"], ref["perplexity"], rtol=1e-5, atol=0)
        assert sorted(got["eval_ids"]) == sorted(ref["eval_ids"])
        if case.get("tied_gap"):  # a tied weight's copies, after every update: bit-identical
            assert got["updates"] == [0.0] * len(ref["loss"])
    params = pipe[0][case["id"]]["params"]  # the whole model lands on the main process
    assert params.keys() == ref["params"].keys()
    for name, value in ref["params"].items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "case", CASES + SWEEP_CASES, ids=[case_of(c)["id"] for c in CASES + SWEEP_CASES]
)
def test_matches_one_process(runs, case):
    pipe, one, _, _ = runs
    _assert_matches(pipe, one, case)


def test_eval_of_a_short_last_batch_is_ddps(runs):
    """run_clm's eval loss and perplexity over 10 rows in steps of 8 (the last batch completed
    with repeated rows, dropped by gather_for_metrics): ZeroPP's equal DDP's (and one
    process's, above), a loss per process, not the pipeline's batch loss."""
    pipe, _, ddp, _ = runs
    for got, want in zip(pipe, ddp, strict=True):
        torch.testing.assert_close(
            got["eval-only"]["eval_loss"], want["ddp-eval"]["eval_loss"], rtol=0, atol=1e-6
        )
        assert sorted(got["eval-only"]["eval_ids"]) == sorted(want["ddp-eval"]["eval_ids"])


def test_a_forward_computing_its_own_loss_is_refused(runs):
    for rank_result in runs[0]:
        error = rank_result["manual-loss"]["error"]
        assert "ManualLossLlama's forward did not compute its loss as its loss_function" in error
        assert "nor as a mean F.cross_entropy over those labels" in error
        assert "Have the forward pass its keyword arguments to self.loss_function" in error


def test_moe_router_logits_are_refused_on_every_rank(runs):
    for rank, rank_result in enumerate(runs[0]):
        error = rank_result["moe-router"]["error"]
        assert "cannot pipeline OlmoeForCausalLM" in error, f"rank {rank}: {error}"
        assert "output_router_logits" in error, f"rank {rank}: {error}"


@pytest.mark.parametrize("case", SWEEP_CASES[:2], ids=[case_of(c)["id"] for c in SWEEP_CASES[:2]])
def test_tied_export_reloads_tied(runs, case):
    """run_clm's closing `unwrap_model(model).save_pretrained(...)` and `save_model` of a tied
    model: one process reloads it tied, with the trained weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    pipe, _, _, out = runs
    assert pipe[0][case["id"]]["unwrapped_tied"]  # unwrap_model gives the model tied
    trained = pipe[0][case["id"]]["params"]
    model = AutoModelForCausalLM.from_pretrained(out / case["id"] / "pretrained")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    state = model.state_dict()
    assert state.keys() == trained.keys()
    for name, value in trained.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    # save_model writes what one process's would: the tied weight once, under its first name
    saved = load_file(out / case["id"] / "save_model" / "model.safetensors")
    head = next(n for n in trained if n.endswith("lm_head.weight"))
    assert saved.keys() == trained.keys() - {head}
    for name, value in saved.items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("case", FAMILY_CASES, ids=[c["id"] for c in FAMILY_CASES])
def test_other_families_match_one_process(family_runs, case):
    _assert_matches(*family_runs, case)


def test_lora_trains_adapters_only(runs):
    """Frozen base weights stay as built and get no optimizer state on any rank; the adapters
    train (as one process trains them: test_matches_one_process)."""
    from tests.distributed.clm_loop import Args, build_model

    pipe, _, _, _ = runs
    start = build_model(Args(lora=True)).state_dict()  # the initial weights (init_seed 0)
    got = pipe[0]["llama-lora"]["params"]
    assert got.keys() == start.keys()
    for name, value in start.items():
        if "lora_" not in name:
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    assert any("lora_" in n and not torch.equal(got[n], v) for n, v in start.items())
    for rank in pipe:
        result = rank["llama-lora"]
        assert result["with_state"] and all("lora_" in n for n in result["with_state"])
        assert result["frozen"] and all("lora_" not in n for n in result["frozen"])


def test_learning_rate_as_under_ddp(runs):
    pipe, _, ddp, _ = runs
    assert ddp[0]["ddp"]["lr"] == pipe[0]["llama-1f1b"]["lr"]
    assert ddp[0]["ddp"]["lr"][-1] == 0.0  # cosine reaches 0 at the last update


def test_padded_batches_really_padded(runs):
    """The data must exercise token weighting: micro-batches with different token counts."""
    from tests.distributed.clm_loop import Texts, collate

    batch = collate([Texts(32, 1)[i] for i in range(8)])
    counts = (batch["labels"][:, 1:] != -100).sum(dim=1).reshape(4, 2).sum(dim=1)
    assert len(set(counts.tolist())) > 1


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    out = tmp_path_factory.mktemp("clm_resume")
    params = {
        "plugin": PP,
        "save_to": str(out / "state"),
        "export_to": str(out / "export"),
        "init_process_group": False,
    }
    return launch(4, "clm_scenarios.resume", params, out / "logs", timeout=600), out


def test_save_state_resumes_exactly(resumed):
    results, _ = resumed
    for r in results:
        full, first, again = r["full"], r["first"], r["resumed"]
        torch.testing.assert_close(first["loss"] + again["loss"], full["loss"], rtol=0, atol=1e-6)
        assert first["lr"] + again["lr"] == full["lr"]
    full, again = results[0]["full"]["params"], results[0]["resumed"]["params"]
    for name, value in full.items():
        torch.testing.assert_close(again[name], value, rtol=0, atol=1e-6, msg=name)


def test_save_state_with_automatic_naming_commits_and_prunes(resumed):
    """Three saves under total_limit=2 leave checkpoint_1 and checkpoint_2 (plain folders, no
    temporaries in checkpoints/ or beside it), and load_state() reads the newest."""
    for r in resumed[0]:
        assert r["automatic"]["listing"] == ["checkpoint_1", "checkpoint_2"]
        assert r["automatic"]["equal"]
    project = Path(resumed[0][0]["automatic"]["project"])
    assert sorted(p.name for p in project.iterdir()) == ["checkpoints"]


def test_gather_for_metrics_returns_each_sample_once(resumed):
    """10 eval rows over 2 data-parallel ranks of 4-row batches: the last batch is completed
    with repeated rows, which gather_for_metrics drops; pipeline ranks add no copies."""
    from tests.distributed.clm_loop import Texts

    firsts = sorted(int(row[0]) for row in Texts(10, 2).rows)
    for r in resumed[0]:
        assert sorted(r["full"]["eval_ids"]) == firsts


def test_unwrap_model_exports_the_trained_weights(resumed):
    from transformers import AutoModelForCausalLM

    results, out = resumed
    loaded = AutoModelForCausalLM.from_pretrained(out / "export").state_dict()
    for name, value in results[0]["full"]["params"].items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
