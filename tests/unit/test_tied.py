"""Tied weights under split="call", without a process group: which names are tied, the dry run's
verdict, and where each stage's copy lives (the gradient sum is tested on gloo ranks in
tests/distributed/test_tied.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zeropp.core.split.blocks import plan_blocks
from lightning_zeropp.core.split.call_plan import CallInputs, plan_calls
from lightning_zeropp.core.split.call_stages import build_call_stages
from lightning_zeropp.core.split.tied import tied_groups
from lightning_zeropp.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, dim=32, num_heads=2, num_layers=4)


def _tied_gpt() -> GPT:
    torch.manual_seed(0)
    model = GPT(CFG)
    model.head.weight = model.tok_emb.weight
    return model


def _hf_tied() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_tied_groups_lists_trainable_shared_tensors_in_model_order():
    model = _tied_gpt()
    assert tied_groups(model) == [("tok_emb.weight", "head.weight")]
    model.tok_emb.weight.requires_grad_(False)  # frozen: no gradient to sum
    assert tied_groups(model) == []
    assert tied_groups(GPT(CFG)) == []


def test_hf_tied_head_passes_the_dry_run_and_each_end_stage_gets_a_copy():
    model = _hf_tied()
    ids = torch.randint(0, 64, (2, 8))
    plan = plan_calls(model, plan_blocks(model, 3), (ids,), {"labels": ids})
    assert plan.first_units == ("model.embed_tokens",) and "lm_head" in plan.last_units
    stages = build_call_stages(model, plan, range(3), CallInputs(), torch.device("cpu"))
    names = [dict(s.named_parameters()) for s in stages]
    emb, head = names[0]["model.embed_tokens.weight"], names[2]["lm_head.weight"]
    assert "lm_head.weight" not in names[0] and "model.embed_tokens.weight" not in names[2]
    assert not any("embed_tokens" in n or "lm_head" in n for n in names[1])  # the middle: none
    assert emb is not head and torch.equal(emb, head)  # own copies, equal at the start
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the model is untouched


class ReadsTiedWeightOutside(nn.Module):
    """A head module tied to the embedding, but the forward reads the weight itself, outside
    both modules: no stage's copy would be the one read."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return F.linear(h, self.head.weight) * 2


def test_a_tied_weight_read_outside_its_modules_is_still_refused():
    model = ReadsTiedWeightOutside()
    with pytest.raises(ValueError, match=r"reads the parameters of 'emb' / 'head' outside"):
        plan_calls(model, plan_blocks(model, 2), (torch.randint(0, 16, (2, 5)),), {})
