"""A model built on the meta device trains as the whole-model path does, each rank holding only
its shards.

One 4-rank launch (pp 2 x dp_shard 2 unless said): the bundled GPT and a plain tied HF Llama,
under 1F1B and the ZeroPP schedule, materialized by their own init or loaded from safetensors
or from a distributed checkpoint of another layout. Each case is checked twice: its weights
right after the build equal an independent whole-model source exactly (the file's tensors, one
process building the model eagerly from the same seed for a model built under
`empty_parameters()`, or one process running `init_weights` for one built under
`torch.device("meta")`), and 3 AdamW steps match one process within 1e-5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.common import make_model, reference
from tests.distributed.conftest import assert_matches_reference, merged_params
from tests.distributed.launch import launch
from tests.distributed.meta_scenarios import gpt_eager, hf_loss, llama, llama_init

pytestmark = pytest.mark.distributed

PP2 = {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 4}
ZEROPP = {**PP2, "schedule": "zeropp", "num_chunks": 2, "unit_size": 2}


# (case, whole model whose weights it must start from, its loss for the reference)
CASES: list[tuple[dict[str, Any], Any, Any]] = [
    # built under empty_parameters(): the init its constructor applies, replayed on the shards
    ({"id": "gpt-init-1f1b", "model": "gpt", "how": "empty", "layout": PP2, "save_dcp": True},
     gpt_eager, None),
    ({"id": "gpt-safetensors-zeropp", "model": "gpt", "how": "empty", "layout": ZEROPP,
      "load_from": "gpt.safetensors"}, make_model, None),
    # the checkpoint the first case wrote under pp 2 x dp 2, read by pp 1 x dp_shard 4
    ({"id": "gpt-dcp-dp4", "model": "gpt", "how": "meta",
      "layout": {"dp_shard_size": 4, "num_microbatches": 2}, "load_from": "dcp"},
     gpt_eager, None),
    ({"id": "llama-hf-dir-1f1b", "model": "llama", "how": "empty", "layout": PP2,
      "load_from": "llama"}, lambda: llama(0), hf_loss),
    # everything on meta, rotary tables included: HF's own _init_weights recomputes them
    ({"id": "llama-init-zeropp", "model": "llama", "how": "meta", "layout": ZEROPP},
     llama_init, hf_loss),
]  # fmt: skip


@pytest.fixture(scope="module")
def results(sources: Path, tmp_path_factory: Any) -> list[Any]:
    root: Path = sources
    dcp_dir = root / "initial_dcp"
    cases = []
    for case, _, _ in CASES:
        case = dict(case)
        if case.get("load_from") == "dcp":
            case["load_from"] = str(dcp_dir)
        elif case.get("load_from"):
            case["load_from"] = str(root / case["load_from"])
        cases.append(case)
    out = tmp_path_factory.mktemp("meta_build")
    params = {"cases": cases, "checkpoint_dir": str(dcp_dir)}
    return launch(4, "meta_scenarios.meta_parity", params, out, timeout=600)


@pytest.mark.parametrize("case,whole,loss", CASES, ids=[c[0]["id"] for c in CASES])
def test_meta_build_matches_whole_model(results: list[Any], case, whole, loss) -> None:
    want = whole().state_dict()
    initial: dict[str, torch.Tensor] = {}
    for rank_result in results:
        initial.update(rank_result[case["id"]]["initial"])
    assert set(initial) <= set(want) and len(initial) >= len(dict(whole().named_parameters()))
    for name, value in initial.items():  # exactly the source's values, on every stage
        assert torch.equal(value, want[name]), name
    ref = reference("adamw", False, 3, model_fn=whole, loss_fn=loss)
    # the reference names a tied weight once; the pipeline holds a copy under each name
    params = merged_params(results, case["id"])
    for name in set(params) - set(ref["params"]):
        torch.testing.assert_close(params[name], params["model.embed_tokens.weight"])
    for r in results:
        for n in set(params) - set(ref["params"]):
            r[case["id"]]["params"].pop(n, None)
    assert_matches_reference(results, {**case, "optimizer": "adamw"}, ref=ref)


def test_meta_build_allocates_only_this_ranks_shards(results: list[Any]) -> None:
    """Before the engine, a rank held no parameter; after, about a quarter of the model."""
    for rank_result in results:
        for case, _, _ in CASES:
            got = rank_result[case["id"]]
            whole = sum(v.numel() for v in got["initial"].values())  # this rank's stages, whole
            assert got["local_numel"] <= whole // 2 + 64  # dp_shard 2 (or 4): half or less
            if case["how"] == "meta":
                assert got["held_before_build"] == 0


def test_first_step_gathers_one_stage_at_a_time(results: list[Any]) -> None:
    """torch infers every stage's shapes on the first step by running a forward through all of a
    rank's stages before any scheduled action; each stage's weights are released right after
    its inference, so no more than one stage is ever gathered at once (ZeroPP: 2 per rank)."""
    several = 0  # ranks holding more than one stage: where gathering them all would show
    for rank_result in results:
        for case, _, _ in CASES:
            got = rank_result[case["id"]]
            peak, stages = got["gathered_peak"], got["stage_bytes"]
            assert 0 < peak <= max(stages), (case["id"], peak, stages)
            assert got["activation_peak"] > 0  # the memory report's other first-step peak
            several += len(stages) > 1
    assert several >= 4
