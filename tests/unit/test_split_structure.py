"""The block list is found by structure, and split="trace" / "stack" either pipeline a model
exactly or refuse it at setup naming why.

torchvision's VisionTransformer (`tests.vision_models`, same module tree) has a 5-child MLP
`nn.Sequential` inside each of its 4 encoder layers: the rule "most children wins" cut inside it.
Lightning's demo Transformer is an encoder-decoder with a data-dependent check in torch's own
`nn.Transformer` (torch.export cannot capture it) and a forward that calls every module.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zeropp.core.split.blocks import find_blocks, plan_blocks
from lightning_zeropp.core.split.methods import split_model
from tests.vision_models import small_vit

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py


def _demo_transformer() -> nn.Module:
    from lightning.pytorch.demos import Transformer

    return Transformer(vocab_size=64, ninp=32, nhead=2, nhid=32, nlayers=2, dropout=0.0)


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))


# ------------------------------------------------------------------------------ the block list
@pytest.mark.parametrize("layers", [4, 6])
def test_torchvision_vit_blocks_are_its_encoder_layers_not_an_mlp(layers):
    container, names = find_blocks(small_vit(layers))
    assert container == "encoder.layers"
    assert names == [f"encoder_layer_{i}" for i in range(layers)]


class ManySmallFewBig(nn.Module):
    """8 small same-class modules (a list of per-layer scales) beside 3 big blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.scales = nn.ModuleList(nn.Linear(1, 1) for _ in range(8))
        self.heads = nn.ModuleDict({"a": nn.Linear(8, 64), "b": nn.LayerNorm(64)})
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))


def test_the_repeated_layers_holding_most_parameters_win_not_the_most_children():
    assert find_blocks(ManySmallFewBig()) == ("blocks", ["0", "1", "2"])


def test_a_container_of_distinct_modules_is_no_block_list():
    model = nn.Module()
    model.parts = nn.ModuleDict({"emb": nn.Embedding(64, 32), "head": nn.Linear(32, 64)})
    with pytest.raises(ValueError, match=r"holding at least 2 layers of one class"):
        find_blocks(model)


def test_the_demo_transformer_blocks_are_its_decoder_layers():
    assert find_blocks(_demo_transformer()) == ("transformer.decoder.layers", ["0", "1"])


# ------------------------------------------------------------------------------ split="trace"
def test_traced_vit_stages_match_the_model_and_send_dense_tensors():
    """torchvision's patch embedding is a permute: activations (and the gradients flowing back)
    leave a stage non-contiguous, which gloo's send refuses. They are made dense."""
    torch.manual_seed(0)
    model = small_vit()
    x = torch.randn(2, 3, 32, 32)
    stages = split_model(model, plan_blocks(model, 2), [0, 1], "trace", (x,))
    h = stages[0](x)
    assert isinstance(h, torch.Tensor) and h.is_contiguous()
    received = h.detach().requires_grad_()
    out = stages[1](received)
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(out, model(x), rtol=0, atol=1e-6)
    # The gradient sent back as the schedules with a split backward compute it (autograd.grad:
    # no layout contract of `.grad`); attention transposes it.
    (grad,) = torch.autograd.grad(out.square().sum(), received)
    assert grad.is_contiguous()


def test_demo_transformer_trace_is_refused_naming_why():
    model = _demo_transformer()
    with pytest.raises(ValueError, match=r"split='trace' cannot capture Transformer as one graph"):
        split_model(model, plan_blocks(model, 2), [0, 1], "trace", _tokens())


# ------------------------------------------------------------------------------ split="stack"
@pytest.mark.parametrize(
    ("build", "example", "name", "dropped"),
    [
        (small_vit, lambda: (torch.randn(2, 3, 32, 32),), "VisionTransformer", "'heads'"),
        (_demo_transformer, _tokens, "Transformer", "'decoder'"),
    ],
    ids=["torchvision-vit", "demo-transformer"],
)
def test_a_forward_that_breaks_the_stack_contract_is_refused_at_setup(
    build, example, name, dropped
):
    model = build()
    with pytest.raises(ValueError, match=rf"split='stack' cannot run {name}: stage 0") as err:
        split_model(model, plan_blocks(model, 2), [0, 1], "stack", example())
    assert dropped in str(err.value) and "split='call'" in str(err.value)


def test_a_forward_that_keeps_the_stack_contract_passes_the_check():
    from lightning_zeropp.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, dim=16, num_heads=2, num_layers=4))
    x = torch.randint(0, 32, (2, 8))
    stages = split_model(model, plan_blocks(model, 2), [0, 1], "stack", (x,))
    torch.testing.assert_close(stages[1](stages[0](x)), model(x), rtol=0, atol=1e-6)
