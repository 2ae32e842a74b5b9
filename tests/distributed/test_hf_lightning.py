"""Plain HF causal LMs in an unmodified LightningModule: `self.model(ids, attention_mask=...,
labels=...).loss` on right-padded batches trains through `ZeroPPStrategy` as in one process
(2 pipeline stages, 2 micro-batches whose labelled-token counts differ), with no preparation call.
"""

from __future__ import annotations

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
