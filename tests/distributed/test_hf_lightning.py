"""Plain HF causal LMs in an unmodified LightningModule: `self.model(ids, attention_mask=...,
labels=...).loss` on right-padded batches trains through `ZeroPPStrategy` as in one process
(2 pipeline stages, 2 micro-batches whose labelled-token counts differ, 4 steps, no clipping),
with no preparation call: untied and tied families (each tied weight's copies compared after
every step), GPT-2 (whose loss shifts labels though its class is no `*ForCausalLM`); a tied
export reloads tied in one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

CASES = [
    {"id": "llama", "family": "llama"},
    {"id": "qwen2", "family": "qwen2"},
    {"id": "gpt2-tied", "family": "gpt2", "tie_word_embeddings": True, "export_to": "<out>"},
    {"id": "opt-tied", "family": "opt", "tie_word_embeddings": True},
    # BERT-MLM returns its own mean cross-entropy (it ignores num_items_in_batch): each
    # micro-batch's mean is rescaled to its token sum over the batch's count (fronts.loss_rule)
    # then validated: validation_step logs the model's own loss (`trainer.validate`)
    {"id": "bert", "family": "bert", "validate": True},
    {"id": "mixtral", "family": "mixtral"},  # mixture of experts, router logits off
]
# HF's MoE load-balancing loss reads every layer's router logits after the last layer (hooks
# record them inside the layers): refused at setup on every rank, naming the setting.
# An asked loss_chunk: the Lightning front keeps an HF model's logits whole (a training_step may
# read them), so it is refused at setup on every rank rather than ignored.
REFUSED = [
    {"id": "mixtral-router", "family": "mixtral+router", "catch": True},
    {"id": "llama-loss-chunk", "family": "llama", "catch": True,
     "settings": {"loss_chunk": 8, "split": "call"}},
]  # fmt: skip
# bench/bench_families.py runs every family through this module too.
SLOW_CASES = [
    {"id": "llama-tied", "family": "llama", "tie_word_embeddings": True},
    {"id": "gemma-tied", "family": "gemma", "tie_word_embeddings": True},
    {"id": "gemma2-tied", "family": "gemma2", "tie_word_embeddings": True},
    *({"id": f, "family": f} for f in ("mistral", "phi3", "gpt_neox")),
]


def _launch(out: Path, cases: list[dict]) -> tuple[dict, dict]:
    cases = [{k: str(out / c["id"]) if v == "<out>" else v for k, v in c.items()} for c in cases]
    common = {"cases": cases, "init_process_group": False}
    strategy = {"pp_size": 2, "num_microbatches": 2}
    got = launch(2, "hf_lightning_scenarios.run_cases", {**common, "strategy": strategy,
                 "devices": 2}, out / "pp")  # fmt: skip
    reference = [{k: v for k, v in c.items() if k != "export_to"} for c in cases]
    ref = launch(1, "hf_lightning_scenarios.run_cases", {**common, "cases": reference,
                 "strategy": None, "devices": 1}, out / "one")  # fmt: skip
    return got, ref[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_lightning")
    return (*_launch(out, CASES + REFUSED), out)


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("hf_lightning_slow"), SLOW_CASES)


def _assert_matches(got: list[dict], ref: dict, case: dict) -> None:
    want = ref[case["id"]]
    for r in got:
        torch.testing.assert_close(r[case["id"]]["losses"], want["losses"], rtol=0, atol=1e-5)
        if case.get("tie_word_embeddings"):  # bit-identical copies after every step
            assert r[case["id"]]["gaps"] == [0.0] * len(want["losses"])
    params = got[0][case["id"]]["params"]
    assert params.keys() == want["params"].keys()
    for name, value in want["params"].items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_plain_hf_model_matches_one_process(runs, case):
    _assert_matches(runs[0], runs[1], case)


def test_bert_validation_step_logs_the_loss_one_process_logs(runs):
    got, ref, _ = runs
    want = ref["bert"]["val_loss"]
    assert want is not None
    for r in got:
        assert r["bert"]["val_loss"] == pytest.approx(want, abs=1e-5)


def test_moe_router_logits_are_refused_on_every_rank(runs):
    got, ref, _ = runs
    assert "error" not in ref["mixtral-router"]  # one process trains it
    for rank, result in enumerate(got):
        error = result["mixtral-router"].get("error", "")
        assert "inside block 0 and not returned by it" in error, f"rank {rank}: {error}"
        assert "output_router_logits" in error, f"rank {rank}: {error}"


def test_an_asked_loss_chunk_is_refused_on_every_rank(runs):
    got, ref, _ = runs
    assert "error" not in ref["llama-loss-chunk"]  # one process: no pipeline, no setting
    for rank, result in enumerate(got):
        error = result["llama-loss-chunk"].get("error", "")
        assert "loss_chunk=8 asks for the head and the loss in chunks, but the Lightning front" in (
            error
        ), f"rank {rank}: {error}"


def test_tied_export_reloads_tied(runs):
    from transformers import AutoModelForCausalLM

    got, _, out = runs
    model = AutoModelForCausalLM.from_pretrained(out / "gpt2-tied")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    trained = got[0]["gpt2-tied"]["params"]
    state = model.state_dict()
    for name, value in trained.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=[c["id"] for c in SLOW_CASES])
def test_other_families_match_one_process(slow_runs, case):
    _assert_matches(*slow_runs, case)


def test_lora_adapters_match_one_process(tmp_path):
    """`get_peft_model(model, LoraConfig(...))` inside the LightningModule, every parameter given
    to AdamW: adapters train as in one process, frozen base weights stay as built and get no
    optimizer state on any rank."""
    from tests.distributed.clm_loop import Args, build_model

    strategy = {"pp_size": 2, "num_microbatches": 2}
    common = {"family": "llama", "lora": True, "init_process_group": False}
    got = launch(
        2,
        "hf_lightning_scenarios.run",
        {**common, "strategy": strategy, "devices": 2},
        tmp_path / "pp",
    )
    ref = launch(
        1,
        "hf_lightning_scenarios.run",
        {**common, "strategy": None, "devices": 1},
        tmp_path / "one",
    )[0]
    start = build_model(Args(lora=True)).state_dict()
    for r in got:
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=0, atol=1e-5)
        assert r["with_state"] and all("lora_" in n for n in r["with_state"])
        assert r["frozen"] and all("lora_" not in n for n in r["frozen"])
    assert got[0]["params"].keys() == ref["params"].keys() == start.keys()
    for name, value in ref["params"].items():
        torch.testing.assert_close(got[0]["params"][name], value, rtol=0, atol=1e-5, msg=name)
        if "lora_" not in name:
            torch.testing.assert_close(got[0]["params"][name], start[name], rtol=0, atol=0)
    assert any(not torch.equal(ref["params"][n], start[n]) for n in start if "lora_" in n)


def _one_process_global_batches() -> dict[str, Any]:
    """One process on each global batch of 8 padded rows: the loss is the mean over all the
    batch's real next tokens."""
    from tests.distributed.clm_loop import Args, Texts, build_model, collate
    from tests.distributed.hf_lightning_scenarios import DP_BATCH, DP_ROWS, DP_STEPS

    model = build_model(Args(family="llama"))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data, losses = Texts(DP_ROWS, 1), []
    for k in range(DP_STEPS):
        batch = collate([data[i] for i in range(k * DP_BATCH, (k + 1) * DP_BATCH)])
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "params": {k: v.detach() for k, v in model.state_dict().items()}}


def test_padded_batches_at_dp2_weigh_every_token_of_the_global_batch(tmp_path):
    """pp 2 x dp_shard 2: HF's own loss (`labels=`) and a step's own masked cross-entropy over
    the logits both give one process's loss and weights, where each rank's and each
    micro-batch's share of real tokens differ (1 row per micro-batch, 3..12 tokens each)."""
    cases = [{"loss": "labels"}, {"loss": "own"}]
    got = launch(
        4,
        "hf_lightning_scenarios.data_parallel",
        {"cases": cases, "init_process_group": False},
        tmp_path,
    )
    ref = _one_process_global_batches()
    for case in ("labels", "own"):
        for r in got:
            torch.testing.assert_close(
                torch.tensor(r[case]["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=1e-5
            )
        for name, value in ref["params"].items():
            torch.testing.assert_close(
                got[0][case]["params"][name], value, rtol=0, atol=1e-5, msg=name
            )
