"""The planner's profile of a model on the meta device: blocks that repeat an earlier one are not
run again, and the figures are those of running every block."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zeropp.core.split import profile, repeats
from lightning_zeropp.models import GPT, GPTConfig
from lightning_zeropp.models.hf import build_causal_lm


def _every_block_run(monkeypatch, model: nn.Module, seq: int) -> tuple:
    with monkeypatch.context() as m:
        m.setattr(repeats.Repeats, "forward", lambda self, i, original: original)
        return profile._profile.__wrapped__(model, seq, None, profile.lm_loss)


def _models() -> dict[str, nn.Module]:
    with torch.device("meta"):
        odd = GPT(GPTConfig(vocab_size=64, seq_len=16, dim=32, num_heads=2, num_layers=6))
        odd.blocks[4].mlp = nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 32))
        return {
            "gpt": GPT(GPTConfig(vocab_size=64, seq_len=16, dim=32, num_heads=2, num_layers=6)),
            "gpt_with_an_odd_block": odd,
            "llama_gqa": build_causal_lm(
                "llama",
                vocab_size=64,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=6,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=16,
            ),  # fmt: skip
        }


@pytest.mark.parametrize("name", list(_models()))
def test_skipping_repeated_blocks_changes_no_figure(monkeypatch, name: str) -> None:
    model = _models()[name]
    skipped = profile._profile.__wrapped__(model, 16, None, profile.lm_loss)
    assert skipped == _every_block_run(monkeypatch, model, 16)
    if name == "gpt_with_an_odd_block":  # the odd block runs, and its figures are its own
        assert skipped[0].blocks[4].flops != skipped[0].blocks[3].flops


def test_repeated_blocks_are_not_run(monkeypatch) -> None:
    model = _models()["gpt"]
    calls = []
    for block in model.blocks:
        block.attn.register_forward_hook(lambda *a: calls.append(1))
    profile._profile.__wrapped__(model, 16, None, profile.lm_loss)
    # 2 rows x (plain, recomputed): each run runs a few blocks (the first of a kind differs:
    # it saves what later ones share), not all 6
    assert 0 < len(calls) <= 4 * 4
