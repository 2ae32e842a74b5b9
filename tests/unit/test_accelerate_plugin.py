"""`ZeroPPPlugin` settings and `ZeroPPAccelerator.prepare`'s refusals, in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_zeropp.accelerate import ZeroPPAccelerator, ZeroPPPlugin
from lightning_zeropp.accelerate.steps import PipelineOutput, accepts_num_items, loss_of
from lightning_zeropp.core.settings.config import ZeroPPConfig


def test_unset_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("ZEROPP_PP_SIZE", "4")
    monkeypatch.setenv("ZEROPP_SCHEDULE", "gpipe")
    settings = ZeroPPPlugin(schedule="1f1b").run_settings()
    assert (settings.config.pp_size, settings.config.schedule) == (4, "1f1b")
    assert settings.describe_env() == "ZEROPP_PP_SIZE=4"  # the schedule came from code
    settings = ZeroPPPlugin(pp_size=2, schedule="1f1b").run_settings()
    assert (settings.config.pp_size, settings.describe_env()) == (2, "")


def test_a_misspelt_setting_names_the_closest_field():
    with pytest.raises(TypeError, match="did you mean 'pp_size'"):
        ZeroPPPlugin(pp_szie=2)
    with pytest.raises(TypeError, match="set them on the config"):
        ZeroPPPlugin(ZeroPPConfig(pp_size=2), num_microbatches=4)


def test_split_defaults_to_auto(monkeypatch):
    monkeypatch.delenv("ZEROPP_SPLIT", raising=False)
    assert ZeroPPPlugin().run_settings().split == "auto"
    monkeypatch.setenv("ZEROPP_SPLIT", "stack")
    assert ZeroPPPlugin().run_settings().split == "stack"
    assert ZeroPPPlugin(split="auto").run_settings().split == "auto"  # code wins


def test_outputs_read_like_hf_outputs():
    out = PipelineOutput(loss=torch.tensor(1.0), logits=torch.zeros(2, 3))
    assert out.loss is out["loss"] is out[0] and out.to_tuple()[1] is out.logits
    assert loss_of(out) is out.loss and loss_of({"loss": out.loss}) is out.loss
    assert loss_of(torch.zeros(2)) is None


def test_hf_causal_lms_take_the_token_count():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    assert accepts_num_items(AutoModelForCausalLM.from_config(config))
    assert not accepts_num_items(nn.Linear(2, 2))


def _objects():
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader([{"input_ids": torch.zeros(4), "labels": torch.zeros(4)}] * 8, batch_size=2)
    return model, opt, loader


def test_a_layout_larger_than_the_launch_says_how_to_start_processes(monkeypatch):
    """The hint names commands that start several CPU processes: torchrun, or `accelerate launch
    --multi_gpu` with cpu=True; not `accelerate launch --cpu --num_processes N`, which starts one
    (its CPU launcher is not the distributed one), so the user would rerun what failed."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    accelerator = ZeroPPAccelerator(zeropp_plugin=ZeroPPPlugin(pp_size=2), cpu=True)
    with pytest.raises(ValueError, match=r"pp_size \(2\).*--num_processes N") as err:
        accelerator.prepare(*_objects())
    hint = str(err.value)
    assert "torchrun --nproc_per_node N" in hint
    assert (
        "accelerate launch --multi_gpu --num_processes N script.py` with Accelerator(cpu=True)"
        in hint
    )
    assert "add --cpu" not in hint


def test_prepare_needs_the_optimizer_and_the_model_first(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    accelerator = ZeroPPAccelerator(zeropp_plugin=ZeroPPPlugin(pp_size=1), cpu=True)
    model, opt, loader = _objects()
    with pytest.raises(ValueError, match="together with its optimizer"):
        accelerator.prepare(model, loader)
    with pytest.raises(ValueError, match="before other data loaders"):
        accelerator.prepare(loader)


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, input_ids, labels=None):
        x = input_ids
        for block in self.blocks:
            x = block(x)
        return {"loss": ((x - labels) ** 2).mean()}


def test_prepare_uses_the_variables_without_calling_them_ignored(monkeypatch, capsys, caplog):
    """The plugin's own settings over the ZEROPP_* variables: a variable it used is not reported
    as ignored (it was), and the layout is printed once at setup, as in the Lightning front."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("ZEROPP_NUM_MICROBATCHES", "2")
    model = _Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = [{"input_ids": torch.randn(4), "labels": torch.randn(4)} for _ in range(8)]
    accelerator = ZeroPPAccelerator(zeropp_plugin=ZeroPPPlugin(pp_size=1), cpu=True)
    try:
        with caplog.at_level("WARNING"):
            pipeline, _, _ = accelerator.prepare(model, opt, DataLoader(rows, batch_size=4))
    finally:  # prepare made a one-process group: later tests make their own
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert pipeline.engine.config.num_microbatches == 2
    assert "ignoring" not in caplog.text
    assert capsys.readouterr().out.count("ZeroPP layout: world 1 = pp 1") == 1  # once, at setup
