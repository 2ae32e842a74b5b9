"""`ZeroPPStrategy` on LightningModules whose network is built on the meta device, as Lightning
users build large models: in `configure_model`, or under `trainer.init_module(empty_init=True)`.

One 4-rank launch (pp 2 x dp_shard 2). Each rank allocates only its shards; the weights come
from safetensors (`load_from=`) or from the network's own init. The logged loss at every step
and every parameter after 3 AdamW steps match one process training the same weights (a file's,
or, for a network whose constructor initializes it, one eager build from the same seed) within
1e-5, from the first step: the init included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.common import make_model, reference, sampler_batches
from tests.distributed.conftest import assert_matches_reference
from tests.distributed.launch import launch
from tests.distributed.meta_scenarios import hf_loss, llama, nano_eager

pytestmark = pytest.mark.distributed

PP2 = {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 4}
ZEROPP = {**PP2, "schedule": "zeropp", "num_chunks": 2, "unit_size": 2}

CASES = [
    ({"id": "configure_model-safetensors-1f1b", "module": "gpt", "layout": PP2,
      "load_from": "gpt.safetensors"}, make_model, None),
    ({"id": "init_module-hf-dir-zeropp", "module": "llama", "layout": ZEROPP,
      "load_from": "llama"}, lambda: llama(0), hf_loss),
    # nanoGPT's init in its constructor: each rank's shards get what an eager build gets
    ({"id": "configure_model-nanogpt-init-zeropp", "module": "nano", "layout": ZEROPP},
     nano_eager, None),
]  # fmt: skip


@pytest.fixture(scope="module")
def results(sources: Path, tmp_path_factory: Any) -> list[Any]:
    cases = []
    for case, _, _ in CASES:
        case = dict(case)
        if case.get("load_from"):
            case["load_from"] = str(sources / case["load_from"])
        cases.append(case)
    params = {"cases": cases, "init_process_group": False}
    out = tmp_path_factory.mktemp("lightning_meta")
    return launch(4, "lightning_meta_scenarios.fit_cases", params, out, timeout=600)


@pytest.mark.parametrize("case,whole,loss", CASES, ids=[c[0]["id"] for c in CASES])
def test_meta_built_module_trains_as_one_process(results, case, whole, loss) -> None:
    assert all(r[case["id"]]["built_on_meta"] for r in results)
    # Lightning's sampler shuffles the training rows (seeded by epoch)
    ref = reference("adamw", False, 3, sampler_batches(3), model_fn=whole, loss_fn=loss)
    for r in results:  # the pipeline names a tied weight twice; the reference once
        for name in set(r[case["id"]]["params"]) - set(ref["params"]):
            r[case["id"]]["params"].pop(name)
    assert_matches_reference(results, case, losses_key="losses", ref=ref)
