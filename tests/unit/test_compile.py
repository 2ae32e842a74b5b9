"""`compile=True` in one process: cut blocks give eager's gradients under torch's split backward,
with every weight gradient computed outside compiled code (`core.shard.compile`).

Inductor's code generation is slow on CPU: the check of the cut runs its regions through
AOTAutograd without it (the same autograd nodes); tests/distributed/test_compile.py holds
inductor's numbers against one eager process.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zeropp.core import ZeroPPConfig
from lightning_zeropp.core import _torch_private as tp
from lightning_zeropp.core._torch_private import stage_backward_input, stage_backward_weight
from lightning_zeropp.core.settings.env import config_from_env
from lightning_zeropp.core.shard.compile import compile_blocks, compile_stats, splits_backward
from lightning_zeropp.plan.activations import task_orders


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class LlamaBlock(nn.Module):
    """Llama's shape: RMSNorm scales, rotary embeddings from a buffer, SwiGLU, no biases."""

    def __init__(self, dim: int = 32, heads: int = 2, seq: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim, bias=False)
        half = dim // heads // 2
        angles = torch.arange(seq)[:, None] * 10000 ** (-torch.arange(half) / half)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:  # (batch, heads, time, head_dim)
        a, b = x.chunk(2, dim=-1)
        cos, sin = self.cos[: x.shape[2]], self.sin[: x.shape[2]]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (
            p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _grads(model: nn.Module, x: torch.Tensor, dy: torch.Tensor, split: bool) -> list[torch.Tensor]:
    """The input's and every parameter's gradient: one backward, or torch's I then W."""
    x = x.clone().requires_grad_()
    y = model(x)
    model.zero_grad(set_to_none=True)
    if split:
        (dx,), groups = stage_backward_input([y], [dy], [x], model.parameters())
        stage_backward_weight(model.parameters(), groups)
    else:
        y.backward(dy)
        dx = x.grad
    return [dx, *(p.grad for p in model.parameters())]


def _compiled_backward_nodes(y: torch.Tensor) -> list[torch.autograd.graph.Node]:
    seen, todo, found = set(), [y.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo += [n for n, _ in node.next_functions]
        if type(node).__name__ == "CompiledFunctionBackward":
            found.append(node)
    return found


def test_regions_give_eager_gradients_under_split_backward_with_weights_outside_compiled_code(
    monkeypatch,
):
    # The only test here compiling LlamaBlock's forward with the regions backend: dynamo keeps
    # that code for the process, so no later test may expect inductor's from it.
    monkeypatch.setattr(tp, "inductor", tp.aot_eager)
    torch.manual_seed(0)
    eager = nn.Sequential(LlamaBlock(), LlamaBlock())
    compiled = copy.deepcopy(eager)
    before = compile_stats()
    compile_blocks(compiled, ["0", "1"], regions=True)
    x, dy = torch.randn(2, 8, 32), torch.randn(2, 8, 32)

    want = _grads(eager, x, dy, split=False)
    for got in (_grads(compiled, x, dy, split=True), _grads(compiled, x, dy, split=False)):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)

    # Which backward ran where: compiled regions in I only (W re-runs no compiled code).
    xr = x.clone().requires_grad_()
    y = compiled(xr)
    phase, ran = ["I"], []
    nodes = _compiled_backward_nodes(y)
    for node in nodes:
        node.register_prehook(lambda grads: ran.append(phase[0]))
    (dx,), groups = stage_backward_input([y], [dy], [xr], compiled.parameters())
    phase[0] = "W"
    stage_backward_weight(compiled.parameters(), groups)
    assert nodes and ran == ["I"] * len(nodes), ran

    stats = {k: v - before.get(k, 0) for k, v in compile_stats().items()}
    # one graph for both blocks (one code object), cut into compiled regions and eager pieces
    assert stats["graphs"] == 1 and stats["eager_pieces"] >= 3
    assert len(nodes) == 2 * stats["regions"] >= 6  # each block's regions
    assert stats["split_runs"] == 3 * 2 and not stats.get("fallbacks")  # 3 forwards, 2 blocks


class ShortLlamaBlock(LlamaBlock):
    """LlamaBlock under another code object: dynamo's code for LlamaBlock.forward is the other
    test's (compiled without inductor)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


@pytest.mark.slow  # inductor's code generation, twice: about 40 s on two loaded cores
def test_regions_follow_new_sequence_lengths_with_one_symbolic_graph():
    """A second length (as batches padded to their longest row bring) recompiles once, with
    symbolic sizes, cut the same way and as exact; a third reuses it."""
    torch.manual_seed(2)
    eager = nn.Sequential(ShortLlamaBlock(), ShortLlamaBlock())
    compiled = copy.deepcopy(eager)
    before = compile_stats()
    compile_blocks(compiled, ["0", "1"], regions=True)
    for seq in (8, 6, 4):
        x, dy = torch.randn(2, seq, 32), torch.randn(2, seq, 32)
        want = _grads(eager, x, dy, split=False)
        for g, w in zip(_grads(compiled, x, dy, split=True), want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    stats = {k: v - before.get(k, 0) for k, v in compile_stats().items()}
    assert stats["graphs"] == 2 and stats["split_runs"] == 3 * 2 and not stats.get("fallbacks")


@pytest.mark.slow  # inductor's code generation: about 15 s on two loaded cores
def test_whole_blocks_compile_as_one_graph_with_eager_gradients():
    torch.manual_seed(1)
    eager = nn.Sequential(LlamaBlock(), LlamaBlock())
    compiled = copy.deepcopy(eager)
    before = compile_stats()
    compile_blocks(compiled, ["0", "1"], regions=False)
    x, dy = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    for g, w in zip(
        _grads(compiled, x, dy, split=False), _grads(eager, x, dy, split=False), strict=True
    ):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    stats = {k: v - before.get(k, 0) for k, v in compile_stats().items()}
    assert stats["graphs"] == 1 and stats["whole_runs"] == 2 and not stats.get("regions")


class _Branching(nn.Module):
    """A forward that branches on a value: no single graph captures it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 if y.sum() > 0 else y


def test_a_block_that_cannot_compile_runs_eagerly_and_says_which():
    torch.manual_seed(0)
    model = nn.Sequential(_Branching(), _Branching())
    want = model(torch.ones(3, 4))
    before = compile_stats().get("fallbacks", 0)
    compile_blocks(model, ["1"], regions=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model(torch.ones(3, 4))
        model(torch.ones(3, 4))  # warned once: the block stays eager
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    messages = [str(w.message) for w in caught if "compile=True" in str(w.message)]
    assert len(messages) == 1, messages
    assert "block '1' could not be compiled" in messages[0] and "runs eagerly" in messages[0]
    assert compile_stats()["fallbacks"] == before + 1


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs",
                                      "interleaved_zb", "zbv", "dualpipev", "zeropp"])  # fmt: skip
@pytest.mark.parametrize("split_backward", [None, False])
def test_regions_exactly_where_the_schedule_runs_weight_gradient_tasks(schedule, split_backward):
    if split_backward is not None and schedule != "zeropp":
        pytest.skip("split_backward is zeropp's")
    cfg = ZeroPPConfig(
        pp_size=2, num_microbatches=4, schedule=schedule, split_backward=split_backward
    ).resolve(2)
    kinds = {kind for order in task_orders(cfg).values() for kind, *_ in order}
    assert splits_backward(cfg.schedule, cfg.split_backward) == ("W" in kinds), kinds


def test_the_setting():
    assert ZeroPPConfig().resolve(2).compile is False
    assert config_from_env({"ZEROPP_COMPILE": "1"}).compile is True
    assert "compile" in {f.name for f in dataclasses.fields(ZeroPPConfig)}
    with pytest.raises(ValueError, match=r"compile='yes' must be True or False"):
        ZeroPPConfig(compile="yes").resolve(2)  # type: ignore[arg-type]
