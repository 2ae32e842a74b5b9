"""Splitting: block discovery, balance, names kept, and clear errors for models that cannot split."""

import pytest
import torch
from torch import nn

from lightning_zeropp.core.split.blocks import find_blocks, plan_blocks
from lightning_zeropp.core.split.methods import check_no_tied_parameters, split_model
from lightning_zeropp.core.split.modules import merge_stage_modules
from lightning_zeropp.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, seq_len=8, dim=16, num_heads=2, num_layers=6)


def test_finds_the_block_stack():
    assert find_blocks(GPT(CFG)) == ("blocks", [str(i) for i in range(6)])


def test_balances_by_parameter_count():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 64), nn.Linear(64, 8))
    plan = plan_blocks(model, 2)
    # the two big layers end up apart from each other's stage as evenly as contiguity allows
    assert [list(r) for r in plan.ranges] == [[0, 1, 2], [3]]
    assert plan.stage_blocks(1) == ["3"]


def test_user_split_points():
    plan = plan_blocks(GPT(CFG), 3, split_points=[1, 5])
    assert [list(r) for r in plan.ranges] == [[0], [1, 2, 3, 4], [5]]
    with pytest.raises(ValueError, match=r"split_points=\[5, 1\] must list 2 strictly increasing"):
        plan_blocks(GPT(CFG), 3, split_points=[5, 1])


def test_more_stages_than_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match=r"has 6 blocks in 'blocks' but the layout needs 8 stages"):
        plan_blocks(GPT(CFG), 8)


def test_model_without_blocks_cannot_split():
    with pytest.raises(ValueError, match=r"no ModuleList, ModuleDict or nn.Sequential"):
        plan_blocks(nn.Linear(4, 4), 2)


def test_tied_weights_are_refused():
    model = GPT(CFG)
    model.head.weight = model.tok_emb.weight
    with pytest.raises(ValueError, match=r"'tok_emb.weight' and 'head.weight' are the same tensor"):
        check_no_tied_parameters(model)


@pytest.mark.parametrize("method", ["stack", "trace"])
def test_stages_keep_names_and_compose_to_the_model(method):
    torch.manual_seed(0)
    model = GPT(CFG)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    plan = plan_blocks(model, 3)
    stages = split_model(model, plan, [0, 1, 2], method, example_args=(x,))
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    h = x
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=1e-6)
    merged = merge_stage_modules([stages[0], stages[2]])
    assert {n for n, _ in merged.named_parameters()} == {
        n for s in (stages[0], stages[2]) for n, _ in s.named_parameters()
    }
