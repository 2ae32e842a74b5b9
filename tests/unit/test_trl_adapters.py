"""DPO's reference for a LoRA policy (`lightning_zeropp/trl/adapters.py`): every lora_B zero is
exactly TRL's reference, the policy inside `use_adapter(model, None)` (adapters disabled), for
Linear and Embedding LoRA layers; and what it does not cover is refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from trl.trainer.utils import use_adapter  # noqa: E402

from lightning_zeropp.trl.adapters import adapters_off, peft_refusals, wrapped_refusal  # noqa: E402
from tests.distributed.trainer_script import LORA_TARGETS, TINY  # noqa: E402


def _peft(**overrides):
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **TINY, tie_word_embeddings=False)
    lora = {
        "r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "target_modules": [*LORA_TARGETS, "embed_tokens"],
        "init_lora_weights": False,  # lora_B random: the adapters change the output
        **overrides,
    }
    return get_peft_model(
        AutoModelForCausalLM.from_config(config), LoraConfig(task_type="CAUSAL_LM", **lora)
    )


def test_lora_b_zero_is_trl_adapters_disabled_exactly():
    model = _peft().train()  # TRL's reference runs in the policy's mode: training
    ids = torch.randint(2, TINY["vocab_size"], (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with use_adapter(model, None):  # TRL 1.16's reference for a PEFT policy
            trl_reference = model(input_ids=ids).logits
        chosen, zeros = adapters_off(list(model.named_parameters()))
        for name, param in chosen:
            param.copy_(zeros[name])
        ours = model(input_ids=ids).logits
    assert not torch.equal(adapted, trl_reference)  # the adapters matter here
    assert torch.equal(ours, trl_reference)
    layers = TINY["num_hidden_layers"] * len(LORA_TARGETS) + 1  # + the embedding's
    assert len(chosen) == layers


def test_what_the_zero_reference_does_not_cover_is_refused():
    assert wrapped_refusal(_peft(), disable_dropout=True) is None
    assert wrapped_refusal(_peft(lora_dropout=0.1), disable_dropout=False) is None  # LoRA's own
    dropout = _peft()
    dropout.base_model.model.model.layers[0].mlp.act_fn = torch.nn.Sequential(
        torch.nn.SiLU(), torch.nn.Dropout(0.2)
    )
    assert "disable_dropout=False with dropout in" in wrapped_refusal(dropout, False)
    assert wrapped_refusal(dropout, True) is None  # TRL set p=0 itself (disable_dropout)
    saved = _peft(modules_to_save=["lm_head"])
    assert "is a ModulesToSaveWrapper" in wrapped_refusal(saved, True)
    dora = _peft(use_dora=True, target_modules=["q_proj"])
    assert "is a LoRA variant (DoraLinearVariant)" in wrapped_refusal(dora, True)
    two = _peft()
    two.add_adapter("ref", LoraConfig(target_modules=["q_proj"]))
    assert "adapters ['default', 'ref'] is not pipelined" in wrapped_refusal(two, True)


def test_peft_arguments_refused_before_anything_runs():
    from peft import IA3Config

    assert peft_refusals({"peft_config": LoraConfig(r=4)}) == []
    (ia3,) = peft_refusals({"peft_config": IA3Config()})
    assert "peft_config=IA3Config is not pipelined" in ia3
    (ref,) = peft_refusals({"peft_config": LoraConfig(r=4), "ref_model": object()})
    assert "peft_config with a ref_model" in ref
    (passed,) = peft_refusals({"model": _peft()})
    assert "a PeftModel passed as the model is not pipelined: TRL then adds a 'ref'" in passed
    (both,) = peft_refusals({"model": _peft(), "ref_model": object()})
    assert "a PeftModel passed as the model with a ref_model is not pipelined" in both
