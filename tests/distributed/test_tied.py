"""Tied embeddings (HF `tie_word_embeddings=True`) under pipeline parallelism match one process.

The embedding's copy lives on the first stage and the head's on the last; the engine sums their
gradients after each step (`core.split.tied`), so both copies take the one-process update. Each case is
compared with one process training the tied model on the same global batches (fp32): loss per
step and every parameter, under both tied names, within 1e-5; the two copies equal.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.common import MAX_NORM, make_batches, make_optimizer, sampler_batches
from tests.distributed.conftest import as_params, merged_params, selected_cases, slow_case
from tests.distributed.launch import launch
from tests.distributed.tied_scenarios import make_tied, model_loss, tied_names

pytestmark = pytest.mark.distributed

PP2 = {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 4}
CASES = [
    # clipping: the global norm counts the tied weight once, as one process does
    {
        "id": "llama-pp2-dp2",
        "family": "llama",
        "layout": PP2,
        "optimizer": "adamw",
        "clip": True,
        "export": True,  # and core.weights.export.full_state_dict afterwards
    },
    # the middle stages hold no copy
    {"id": "llama-pp4", "family": "llama", "layout": {"pp_size": 4, "num_microbatches": 4}},
    # stages 0 and 2 on pipeline rank 0, 1 and 3 on rank 1
    {
        "id": "llama-interleaved",
        "family": "llama",
        "layout": {**PP2, "schedule": "interleaved_1f1b"},
    },
    # a V: stages 0 and 3 on pipeline rank 0, which sums both copies locally; rank 1 holds none
    {"id": "llama-zbv", "family": "llama", "layout": {**PP2, "schedule": "zbv"}},
    {"id": "gemma-pp2-dp2", "family": "gemma", "layout": PP2, "optimizer": "adamw"},
    # HSDP: the copies' shards are replicated over dp_replicate and split over dp_shard (1 here)
    {
        "id": "llama-hsdp",
        "family": "llama",
        "layout": {**PP2, "dp_shard_size": 1, "dp_replicate_size": 2},
    },
    # ZeroPP's own unit schedule
    {"id": "llama-zeropp", "family": "llama", "layout": {**PP2, "schedule": "zeropp"}},
    # two train_steps per optimizer step: each step sums its own gradients only
    {"id": "llama-accumulate2", "family": "llama", "layout": PP2, "accumulate": 2},
    # split="stack" copies modules the same way
    {"id": "gpt-stack", "family": "gpt", "layout": PP2, "split": "stack"},
]
# Placements another case covers in CI (a stage without a copy: zbv's rank 1; copies on one rank:
# zbv's rank 0; replicated shards and accumulation: the untied suites), left to
# bench/slow_tests.py for time.
SLOW = {"llama-pp4", "llama-interleaved", "llama-hsdp", "llama-accumulate2"}
ENTRIES = [slow_case(c) if c["id"] in SLOW else c for c in CASES]


def _reference(family, optimizer="sgd", clip=False, steps=3, batches=None, accumulate=1):
    model = make_tied(family)
    opt = make_optimizer(optimizer, model.parameters())
    losses, norms = [], []
    for i, (x, y) in enumerate(batches or make_batches(steps * accumulate)):
        loss = model_loss(family, model, x, y)
        loss.backward()
        losses.append(float(loss.detach()))
        if (i + 1) % accumulate:
            continue
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    named = model.named_parameters(remove_duplicate=False)  # both tied names
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in named}}


def _assert_parity(losses, params, ref, names):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), atol=1e-5, rtol=0)
    assert params.keys() == ref["params"].keys()
    for name, want in ref["params"].items():
        torch.testing.assert_close(
            params[name], want, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
    first, second = names
    assert torch.equal(params[first], params[second]), "the tied copies drifted apart"


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("tied")
    checkpoint = {
        "out": str(out),
        "layout": PP2,
        "load_layout": {"pp_size": 4, "num_microbatches": 4},
    }
    cases = [dict(c) for c in selected_cases(request, ENTRIES)]
    params = {"cases": cases, "checkpoint": checkpoint}
    return launch(4, "tied_scenarios.engine_cases", params, out)


@pytest.mark.parametrize("case", as_params(ENTRIES))
def test_tied_model_matches_one_process(results, case):
    ref = _reference(
        case["family"],
        case.get("optimizer", "sgd"),
        case.get("clip", False),
        accumulate=case.get("accumulate", 1),
    )
    for rank_result in results:  # every rank reports the global loss
        got = rank_result[case["id"]]
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(ref["losses"]), atol=1e-5, rtol=0
        )
    params = merged_params(results, case["id"])
    _assert_parity(results[0][case["id"]]["losses"], params, ref, tied_names(case["family"]))
    if case.get("clip"):
        norms = results[0][case["id"]]["norms"]
        torch.testing.assert_close(
            torch.tensor(norms), torch.tensor(ref["norms"]), atol=1e-6, rtol=1e-5
        )
        assert max(ref["norms"]) > MAX_NORM  # clipping really scaled the gradients


def test_full_state_dict_holds_both_names_with_equal_values(results):
    ref = _reference("llama", "adamw", clip=True)
    state = results[0]["llama-pp2-dp2"]["full"]
    assert list(state) == list(make_tied("llama").state_dict())  # every name, in model order
    for name, want in ref["params"].items():
        torch.testing.assert_close(state[name], want, atol=1e-5, rtol=0)
    first, second = tied_names("llama")
    assert torch.equal(state[first], state[second])
    assert all(r["llama-pp2-dp2"]["full"] == {} for r in results[1:])  # rank 0 only


def test_full_optimizer_state_is_one_process_s(results):
    """The optimizer state as one process's `optimizer.state_dict()`: the tied weight once,
    under its first name, its state the one process's."""
    model = make_tied("llama")
    opt = make_optimizer("adamw", model.parameters())
    for x, y in make_batches(3):
        model_loss("llama", model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    want = opt.state_dict()
    got = results[0]["llama-pp2-dp2"]["full_optimizer"]
    names = [n for n, _ in model.named_parameters()]  # each tensor once: the first name
    assert [g["param_names"] for g in got["param_groups"]] == [names]
    assert got["param_groups"][0]["params"] == want["param_groups"][0]["params"]
    for i, state in want["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got["state"][i][key], value, atol=1e-5, rtol=0)


def test_full_load_of_one_process_state(results):
    """A one-process model and optimizer state (numbered, the tied weight once) loaded into the
    pipeline with `load_full`: every copy gets the tied weight's state; step 3 is one
    process's."""
    ref = _reference("llama", "adamw")
    out = [r["from_one_process"] for r in results]
    assert abs(out[0]["loss"] - ref["losses"][2]) < 1e-5
    params = merged_params([{"c": {"params": r["params"]}} for r in out], "c")
    _assert_parity(ref["losses"], params, ref, tied_names("llama"))


def test_trace_split_refuses_tied_weights(results):
    for r in results:
        assert "'tok_emb.weight' and 'head.weight' are the same tensor" in r["trace_error"]
        assert "Use split='call'" in r["trace_error"]


def test_checkpoint_round_trip_under_another_layout(results):
    """Saved under pp 2 x dp 2 after 2 steps, loaded under pp 4 into other weights, step 3."""
    out = [r["checkpoint"] for r in results]
    ref = _reference("llama", "adamw")
    saved = merged_params([{"c": {"params": r["saved"]}} for r in out], "c")
    loaded = merged_params([{"c": {"params": r["loaded"]}} for r in out], "c")
    before = merged_params([{"c": {"params": r["before"]}} for r in out], "c")
    first, second = tied_names("llama")
    assert not torch.equal(before[first], saved[first])  # the load had something to do
    assert saved.keys() == loaded.keys() == ref["params"].keys()
    for name in saved:
        assert torch.equal(loaded[name], saved[name]), name
    final = merged_params([{"c": {"params": r["params"]}} for r in out], "c")
    _assert_parity(out[0]["losses"], final, ref, (first, second))


def test_lightning_front_matches_one_process(tmp_path):
    params = {"family": "llama", "layout": PP2, "init_process_group": False}
    out = launch(4, "tied_scenarios.lightning_fit", params, tmp_path)
    ref = _reference("llama", batches=sampler_batches(3))
    params = merged_params([{"c": {"params": r["params"]}} for r in out], "c")
    _assert_parity(out[0]["logged"], params, ref, tied_names("llama"))
