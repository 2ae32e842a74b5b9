"""Plain HF causal LMs in an unmodified LightningModule: `self.model(ids, attention_mask=...,
labels=...).loss` on right-padded batches trains through `ZeroPPStrategy` as in one process
(2 pipeline stages, 2 micro-batches whose labelled-token counts differ), with no preparation call.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

FAMILIES = ["llama", "qwen2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_hf_model_matches_one_process(tmp_path, family):
    strategy = {"pp_size": 2, "num_microbatches": 2}
    common = {"family": family, "init_process_group": False}
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
    for r in got:
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=0, atol=1e-5)
    for name, value in ref["params"].items():
        torch.testing.assert_close(got[0]["params"][name], value, rtol=0, atol=1e-5, msg=name)


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
