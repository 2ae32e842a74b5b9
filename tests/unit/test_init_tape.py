"""The init a constructor applies, recorded on the meta device and replayed on shards, equals an
eager build from the same random state (`core.weights.init_tape`)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_zeropp.core.weights.init_record import tape_of
from lightning_zeropp.core.weights.init_tape import targets_by_ref
from lightning_zeropp.core.weights.materialize import empty_parameters
from lightning_zeropp.models.gpt import Block, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, dim=32, num_heads=2, num_layers=4)


class NanoGPT(nn.Module):
    """nanoGPT's init: in the constructor, `apply(_init_weights)`, then scaled and zeroed
    projections, a tied head, plus an in-place write through `.data` and orthogonal_."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(CFG.vocab_size, CFG.dim)
        self.pos_emb = nn.Parameter(torch.zeros(CFG.seq_len, CFG.dim))
        self.blocks = nn.ModuleList(Block(CFG) for _ in range(CFG.num_layers))
        self.ln_f = nn.LayerNorm(CFG.dim)
        self.head = nn.Linear(CFG.dim, CFG.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        nn.init.normal_(self.pos_emb, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.zeros_(p)
            if name.endswith("mlp.2.weight"):
                nn.init.trunc_normal_(p, std=0.02 / math.sqrt(2 * CFG.num_layers))
        self.blocks[0].attn.qkv.weight.data[0].zero_()
        nn.init.orthogonal_(self.blocks[1].attn.qkv.weight)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)


def _replayed(build, seed: int = 0) -> tuple[nn.Module, set[int], dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    with empty_parameters():
        model = build()
    recorded = tape_of(model)
    assert recorded is not None
    tape, refs = recorded
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    bad, end = tape.replay(targets_by_ref([model], refs), torch.device("cpu"))
    return model, bad, end


def test_replay_equals_the_eager_build_and_the_generator_goes_on_alike() -> None:
    torch.manual_seed(0)
    eager = NanoGPT()
    after_eager = torch.rand(4)
    model, bad, end = _replayed(NanoGPT)
    assert not bad
    got = dict(model.named_parameters(remove_duplicate=False))  # to_empty untied the copies
    for name, want in eager.named_parameters(remove_duplicate=False):
        assert torch.equal(got[name], want), name
    torch.set_rng_state(end["cpu"])
    assert torch.equal(torch.rand(4), after_eager)


def test_replay_keeps_each_ranks_rows_of_a_sharded_copy() -> None:
    """A parameter held as rows [4, 12) of the whole gets exactly those rows."""
    torch.manual_seed(0)
    eager = NanoGPT()
    torch.manual_seed(0)
    with empty_parameters():
        model = NanoGPT()
    tape, refs = tape_of(model)
    part = torch.full((8, CFG.dim), float("nan"))
    chunk = (slice(4, 12), slice(0, CFG.dim))
    import lightning_zeropp.core.weights.init_tape as init_tape

    real_chunk = init_tape.local_chunk
    init_tape.local_chunk = lambda t: chunk if t is part else real_chunk(t)
    try:
        bad, _ = tape.replay({refs["pos_emb"]: [part]}, torch.device("cpu"))
    finally:
        init_tape.local_chunk = real_chunk
    assert not bad and torch.equal(part, eager.pos_emb.detach()[4:12])


class Foreign(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3, 3))
        with torch.no_grad():
            self.w.copy_(torch.empty(3, 3, device="meta"))  # a meta value the tape never saw


def test_an_init_the_tape_cannot_replay_is_named() -> None:
    _, bad, _ = _replayed(Foreign)
    assert bad  # the engine names these parameters (see `fill_values`)


@pytest.mark.parametrize("seed", [0, 7])
def test_replay_follows_the_seed(seed: int) -> None:
    torch.manual_seed(seed)
    eager = NanoGPT()
    model, _, _ = _replayed(NanoGPT, seed)
    assert torch.equal(model.tok_emb.weight, eager.tok_emb.weight)
