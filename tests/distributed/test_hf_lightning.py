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
