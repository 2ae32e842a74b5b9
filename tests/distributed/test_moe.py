"""Experts as separate modules under data parallelism: an expert that one data-parallel rank's
rows never reach has no gradient there and one on its peer. FSDP reduce-scatters only the
parameters holding a gradient, so before the ranks sent buffers of different sizes and the first
step ended in gloo's "40 vs 20" bytes size mismatch; now such a gradient is zero on that rank
(`core._torch_private.fsdp.fill_missing_gradients`) and training equals one process's (loss and
parameters, 1e-5), with SGD and AdamW (an expert no row of the whole batch reaches keeps no
gradient, as in one process, so AdamW skips it there too)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    params = {"optimizers": ["sgd", "adamw"], "aux": True}
    return launch(4, "moe_scenarios.run", params, tmp_path_factory.mktemp("moe"), timeout=300)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_experts_unused_on_one_rank_match_one_process(results, optimizer):
    for rank_results in results:
        got = rank_results[optimizer]
        assert got["unused"], "the batches must leave an expert unused on one rank only"
        one = got["one"]
        torch.testing.assert_close(got["losses"], one["losses"], rtol=0, atol=1e-5)
    params = {**results[0][optimizer]["params"], **results[2][optimizer]["params"]}  # 2 stages
    assert params.keys() == one["params"].keys()
    for name, value in one["params"].items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-5, msg=name)


def test_blocks_returning_an_aux_loss_match_one_process_accumulating(results):
    """Blocks returning `(x, aux)`, the model summing the aux values after the blocks and the loss
    adding them (before: refused by split='call'): at pp 2 x dp 2 the loss and parameters equal
    one process accumulating the same micro-batches (1e-5)."""
    one = results[0]["aux"]["one"]
    k = results[0]["aux"]["micro_per_step"]
    want = [sum(one["losses"][i : i + k]) / k for i in range(0, len(one["losses"]), k)]
    for rank_results in results:
        torch.testing.assert_close(rank_results["aux"]["losses"], want, rtol=0, atol=1e-5)
    params = {**results[0]["aux"]["params"], **results[2]["aux"]["params"]}  # the 2 stages
    assert params.keys() == one["params"].keys()
    for name, value in one["params"].items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-5, msg=name)
