"""Traced stages become a chain: values read by non-adjacent stages are relayed in between."""

import copy

import torch
from torch import nn

from lightning_zeropp.core.split.blocks import plan_blocks
from lightning_zeropp.core.split.methods import split_model


class SkipModel(nn.Module):
    """Stage 0 computes `scale` and `h0`; every later stage reads them (skip edges)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.emb(x)
        scale = x.sum(-1, keepdim=True).sigmoid()  # needs no grad
        h = h0
        for block in self.blocks:
            h = block(h) * scale + h0  # h0 requires grad
        return self.head(h)


def _run(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    out: tuple = (x,)
    for stage in stages:
        got = stage(*out)
        out = got if isinstance(got, tuple) else (got,)
    return out[0]


def test_skip_edges_are_relayed_and_the_result_is_unchanged():
    torch.manual_seed(0)
    model = SkipModel()
    x = torch.randn(3, 4)
    stages = split_model(model, plan_blocks(model, 4), range(4), "trace", example_args=(x,))
    torch.testing.assert_close(_run(stages, x), model(x), rtol=0, atol=1e-6)
    # Each middle stage passes on its own result plus the two values later stages still read.
    for stage in stages[1:3]:
        outputs = next(n for n in stage.graph.nodes if n.op == "output").args[0]
        assert len(outputs) == 3
    names = sorted(n for s in stages for n, _ in s.named_parameters())
    assert names == sorted(n for n, _ in model.named_parameters())


def test_gradients_flow_through_relayed_values():
    torch.manual_seed(0)
    model = SkipModel()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    stages = split_model(model, plan_blocks(model, 3), range(3), "trace", example_args=(x,))
    _run(stages, x).square().sum().backward()
    ref(x).square().sum().backward()
    got = {n: p.grad for s in stages for n, p in s.named_parameters()}
    assert got.keys() == dict(ref.named_parameters()).keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, ref.get_parameter(name).grad, rtol=0, atol=1e-6)
