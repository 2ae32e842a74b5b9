"""split="call" without a process group: stages cut at the model's block calls, chained by hand.

They compose to the model exactly (outputs and gradients, any batch shape), keep parameter names and
state dict keys, place outer modules by call order, and a model the cut cannot pipeline exactly is
refused with a message naming what is at fault.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zeropp.core.split.blocks import plan_blocks
from lightning_zeropp.core.split.call_plan import CallInputs, CallPlan, plan_calls
from lightning_zeropp.core.split.call_stages import build_call_stages
from lightning_zeropp.core.split.methods import split_model
from lightning_zeropp.models import GPT, GPTConfig

CPU = torch.device("cpu")
D = 8  # width of the toy models


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py


def _stages(
    model: nn.Module, num_stages: int, args: tuple
) -> tuple[CallPlan, CallInputs, list[nn.Module]]:
    plan = plan_calls(model, plan_blocks(model, num_stages), args, {})
    inputs = CallInputs()
    return plan, inputs, build_call_stages(model, plan, range(num_stages), inputs, CPU)


def _run(stages: list[nn.Module], inputs: CallInputs, args: tuple) -> torch.Tensor:
    """What the pipeline does for one micro-batch: every stage gets the model inputs, stage k > 0
    also what stage k - 1 returned."""
    flat = inputs.flatten(args, {})
    out: tuple = ()
    for stage in stages[:-1]:
        out = stage(*out, **flat)
        assert isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out)
    return stages[-1](*out, **flat)


def _tokens(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq))


# ------------------------------------------------------------------------------ models
def _bundled_gpt(num_layers: int = 4) -> nn.Module:
    return GPT(GPTConfig(vocab_size=64, seq_len=16, dim=32, num_heads=2, num_layers=num_layers))


def _litgpt(num_layers: int = 4) -> nn.Module:
    from litgpt.config import Config
    from litgpt.model import GPT as LitGPT

    cfg = Config(
        block_size=16, n_layer=num_layers, n_embd=32, n_head=2, vocab_size=64, padded_vocab_size=64
    )
    return LitGPT(cfg)


def _demo_transformer(num_layers: int = 2) -> nn.Module:
    from lightning.pytorch.demos import Transformer

    return Transformer(vocab_size=64, ninp=32, nhead=2, nhid=32, nlayers=num_layers, dropout=0.0)


class BareParams(nn.Module):
    """Parameters held by the model itself: a learned position table read before the blocks and
    a learned logit scale (CLIP's) read after them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.pos = nn.Parameter(torch.randn(16, 32) * 0.1)
        self.blocks = nn.ModuleList(_MLP() for _ in range(4))
        self.head = nn.Linear(32, 64)
        self.logit_scale = nn.Parameter(torch.tensor(0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(h) * self.logit_scale.exp()


class ViTLike(nn.Module):
    """ViT's shape: a class token and a position table (parameters of the model), blocks in an
    nn.Sequential called as one module, a head reading the class token's row."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(12, 32)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 32) * 0.1)
        self.pos_embed = nn.Parameter(torch.randn(1, 5, 32) * 0.1)
        self.blocks = nn.Sequential(*(_MLP() for _ in range(4)))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 10)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.patch(patches)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.lin(h).tanh()


def _patch_batches() -> list[tuple]:
    return [(torch.randn(2, 4, 12),), (torch.randn(3, 4, 12),)]


def _lm_batches() -> list[tuple]:
    # The example micro-batch the plan is made with, then another batch size and sequence length.
    return [(_tokens(2, 16),), (_tokens(3, 9),)]


def _seq2seq_batches() -> list[tuple]:
    return [(_tokens(2, 8), _tokens(2, 8)), (_tokens(3, 5), _tokens(3, 5))]


# (name, build model, micro-batches (the first is the planning example), stage counts)
MODELS: list[tuple[str, Callable[[], nn.Module], Callable[[], list[tuple]], tuple[int, ...]]] = [
    ("gpt", _bundled_gpt, _lm_batches, (2, 4)),
    ("litgpt", _litgpt, _lm_batches, (2, 4)),
    ("demo-transformer", _demo_transformer, _seq2seq_batches, (2,)),
    ("demo-transformer-4-layers", lambda: _demo_transformer(4), _seq2seq_batches, (4,)),
    ("bare-params", BareParams, _lm_batches, (2, 4)),
    ("vit-like", ViTLike, _patch_batches, (2,)),
]
CASES = [
    pytest.param(build, batches, n, id=f"{name}-{n}-stages")
    for name, build, batches, counts in MODELS
    for n in counts
]


# ------------------------------------------------------------------------------ 1. exactness
@pytest.mark.parametrize(("build", "batches", "num_stages"), CASES)
def test_chained_stages_match_the_model_outputs_and_gradients_at_any_shape(
    build, batches, num_stages
):
    torch.manual_seed(0)
    model = build()
    batches = batches()
    _, inputs, stages = _stages(model, num_stages, batches[0])
    # Parameters keep their names; each lives on exactly one stage.
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    for args in batches:
        model.zero_grad(set_to_none=True)
        for stage in stages:
            stage.zero_grad(set_to_none=True)
        out, ref = _run(stages, inputs, args), model(*args)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
        weights = torch.randn_like(ref)
        (out * weights).sum().backward()
        (ref * weights).sum().backward()
        for stage in stages:
            for name, param in stage.named_parameters():
                expected = model.get_parameter(name).grad
                assert param.grad is not None and expected is not None, name
                torch.testing.assert_close(param.grad, expected, rtol=0, atol=1e-6, msg=name)


def test_split_model_call_builds_the_same_stages():
    torch.manual_seed(0)
    model = _bundled_gpt()
    example, other = _lm_batches()
    inputs = CallInputs()
    plan = plan_blocks(model, 2)
    stages = split_model(model, plan, [0, 1], "call", (example[0],), call_inputs=inputs, device=CPU)
    later = ("blocks.2.", "blocks.3.", "norm.", "head.")
    names = [n for n, _ in model.named_parameters()]
    assert [sorted(n for n, _ in s.named_parameters()) for s in stages] == [
        sorted(n for n in names if not n.startswith(later)),
        sorted(n for n in names if n.startswith(later)),
    ]
    torch.testing.assert_close(_run(stages, inputs, other), model(*other), rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------ 2. refusals
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.lin(h).relu()


class Toy(nn.Module):
    """emb -> 4 blocks -> head; subclasses write the forward."""

    def __init__(self, block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, D)
        self.blocks = nn.ModuleList(block() for _ in range(4))
        self.head = nn.Linear(D, 16)


class Chain(Toy):
    """The shape split="call" pipelines."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class SkipAroundBlocks(Toy):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.emb(x)
        h = h0
        for block in self.blocks:
            h = block(h)
        return self.head(h + h0)


class ReturnsEmbeddings(Toy):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h0 = self.emb(x)
        h = h0
        for block in self.blocks:
            h = block(h)
        return self.head(h), h0  # no op after the blocks reads h0: only the output holds it


class CallsABlockTwice(Toy):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.blocks[0](h))


class CallsBlocksInReverse(Toy):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in reversed(self.blocks):
            h = block(h)
        return self.head(h)


class NormBetweenBlocks(Toy):
    def __init__(self) -> None:
        super().__init__()
        self.mid_norm = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == 1:
                h = self.mid_norm(h)
        return self.head(h)


class TiedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, D)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.norm = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return F.linear(self.norm(h), self.emb.weight)  # the head is the embedding matrix


class IndexedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, index: torch.Tensor | int) -> torch.Tensor:
        return h + self.lin(h) * index


class BlockIndexTensor(Toy):
    def __init__(self) -> None:
        super().__init__(IndexedBlock)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for i, block in enumerate(self.blocks):
            h = block(h, torch.tensor(float(i + 1)))
        return self.head(h)


class BlockIndexInt(BlockIndexTensor):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for i, block in enumerate(self.blocks):
            h = block(h, i + 1)
        return self.head(h)


class BlockScaleFromEmbedding(BlockIndexTensor):
    """Each block's second argument is computed from the embedding's output: one value per
    block, which the pipeline cannot send once for all."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        scale = h.mean()
        for i, block in enumerate(self.blocks):
            h = block(h, scale * (i + 1))
        return self.head(h)


class CachedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.lin(h) * self.cache  # set by the model's forward


class CacheAttribute(Toy):
    def __init__(self) -> None:
        super().__init__(CachedBlock)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            block.cache = h.mean(-1, keepdim=True)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class GatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(
        self, h: torch.Tensor, gate: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        return gate(h + self.lin(h))


class Closure(Toy):
    def __init__(self) -> None:
        super().__init__(GatedBlock)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.emb(x)

        def gate(h: torch.Tensor) -> torch.Tensor:  # the same callable for every block
            return h * h0.sigmoid()

        h = h0
        for block in self.blocks:
            h = block(h, gate)
        return self.head(h)


class BareTied(Toy):
    """One bare table as input embedding and output projection: it would need two stages."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.embedding(x, self.table)
        for block in self.blocks:
            h = block(h)
        return h @ self.table.T


OTHER_ARGS = (
    r"a block argument computed from an outer module's output must be the same for every block"
)
READS_EMB = r"block 0 reads a value computed from the output of 'emb' other than through the blocks' arguments"
REFUSED = [
    (SkipAroundBlocks, r"after the last block reads a value computed from the output of 'emb'"),
    (ReturnsEmbeddings, r"the model's output depends on values other than its last block's output"),
    (
        CallsABlockTwice,
        r"call each block of 'blocks' once, in order \(it called \['0', '1', '2', '3', '0'\]\)",
    ),
    (
        CallsBlocksInReverse,
        r"call each block of 'blocks' once, in order \(it called \['3', '2', '1', '0'\]\)",
    ),
    (NormBetweenBlocks, r"module 'mid_norm' is called between or both before and after the blocks"),
    (TiedHead, r"its forward reads the parameters of 'emb' outside 'emb' \(linear\)"),
    (
        BareTied,
        r"its forward reads parameter 'table' \(held outside any submodule\) before and after",
    ),
    (BlockScaleFromEmbedding, OTHER_ARGS),
    (CacheAttribute, READS_EMB),
    (Closure, READS_EMB),
]


@pytest.mark.parametrize(("cls", "match"), REFUSED, ids=[c.__name__ for c, _ in REFUSED])
def test_models_the_call_split_cannot_pipeline_exactly_are_refused(cls, match):
    torch.manual_seed(0)
    model = cls()
    with pytest.raises(ValueError, match=match) as err:
        plan_calls(model, plan_blocks(model, 2), (torch.randint(0, 16, (2, 5)),), {})
    assert f"split='call' cannot pipeline {cls.__name__}: " in str(err.value)
    assert "use split='trace'" in str(err.value)  # the way out


@pytest.mark.parametrize("cls", [BlockIndexTensor, BlockIndexInt])
def test_block_arguments_from_the_inputs_alone_may_differ_by_block(cls):
    """Each stage computes them itself, block by block (Gemma2's masks alternate by layer)."""
    torch.manual_seed(0)
    model = cls()
    _, inputs, stages = _stages(model, 2, (torch.randint(0, 16, (2, 5)),))
    x = torch.randint(0, 16, (3, 7))
    torch.testing.assert_close(_run(stages, inputs, (x,)), model(x), rtol=0, atol=1e-6)


def test_the_toy_chain_itself_is_accepted_and_exact():
    # The refused models above differ from this one only where the message points.
    torch.manual_seed(0)
    model = Chain()
    _, inputs, stages = _stages(model, 4, (torch.randint(0, 16, (2, 5)),))
    x = torch.randint(0, 16, (3, 7))
    torch.testing.assert_close(_run(stages, inputs, (x,)), model(x), rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------ 3. placement
class HeadFirst(nn.Module):
    """Registers its head before its embedding and blocks (as litgpt registers lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(D, 16)
        self.emb = nn.Embedding(16, D)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.norm = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


@pytest.mark.parametrize(
    ("build", "args", "first", "last"),
    [
        (HeadFirst, (torch.randint(0, 16, (2, 5)),), {"emb"}, {"head", "norm"}),
        (_litgpt, (_tokens(2, 16),), {"transformer.wte"}, {"lm_head", "transformer.ln_f"}),
    ],
    ids=["toy", "litgpt"],
)
def test_outer_modules_go_where_the_forward_calls_them_not_where_they_are_registered(
    build, args, first, last
):
    torch.manual_seed(0)
    model = build()
    plan, inputs, stages = _stages(model, 2, args)
    assert set(plan.first_units) == first and set(plan.last_units) == last
    for unit in last:
        assert any(n.startswith(f"{unit}.") for n, _ in stages[1].named_parameters())
        assert not any(n.startswith(f"{unit}.") for n, _ in stages[0].named_parameters())
    torch.testing.assert_close(_run(stages, inputs, args), model(*args), rtol=0, atol=1e-6)


def test_parameters_held_by_the_model_go_with_the_stage_that_reads_them():
    torch.manual_seed(0)
    model = BareParams()
    plan, _, stages = _stages(model, 2, (_tokens(2, 16),))
    assert (plan.first_params, plan.last_params) == (("pos",), ("logit_scale",))
    held = [{n for n, _ in s.named_parameters()} for s in stages]
    assert "pos" in held[0] and "logit_scale" in held[1]
    assert "pos" not in held[1] and "logit_scale" not in held[0]
    # the other stage computes on zeros it discards, never on a copy of the weights
    assert not stages[1].pos.any() and not isinstance(stages[1].pos, nn.Parameter)


# ------------------------------------------------------------------------------ 4. state dicts
class Scaled(nn.Module):
    """A block with a persistent buffer (saved) and a non-persistent one (not saved)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("gain", torch.full((D,), 0.5))
        self.register_buffer("scratch", torch.ones(D), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.lin(h) * self.gain * self.scratch


class PositionTable(nn.Module):
    """No parameters, one persistent buffer: every stage keeps a copy (it runs on every stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(16, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[: x.shape[1]]


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, 16)
        self.register_buffer("temperature", torch.tensor(2.0))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h) / self.temperature


class Buffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, D)
        self.pos = PositionTable()
        self.blocks = nn.ModuleList(Scaled() for _ in range(4))
        self.norm = nn.LayerNorm(D)
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _under(key: str, prefixes: list[str]) -> bool:
    return any(key == p or key.startswith(f"{p}.") for p in prefixes)


@pytest.mark.parametrize(
    ("build", "args", "num_stages"),
    [
        (Buffers, (torch.randint(0, 16, (2, 5)),), 2),
        (Buffers, (torch.randint(0, 16, (2, 5)),), 4),
        (_bundled_gpt, (_tokens(2, 16),), 4),
        (_litgpt, (_tokens(2, 16),), 2),
        (_demo_transformer, (_tokens(2, 8), _tokens(2, 8)), 2),
    ],
    ids=["buffers-2", "buffers-4", "gpt-4", "litgpt-2", "demo-transformer-2"],
)
def test_stage_state_dict_keys_are_the_models_for_what_the_stage_holds(build, args, num_stages):
    torch.manual_seed(0)
    model = build()
    full = model.state_dict()
    plan, _, stages = _stages(model, num_stages, args)
    blocks = plan.blocks
    owned = [blocks.fqn(i) for i in range(len(blocks.names))]
    owned += [*plan.first_units, *plan.last_units]
    shared = {k for k in full if not _under(k, owned)}  # modules without parameters: everywhere
    seen: set[str] = set()
    for s, stage in enumerate(stages):
        holds = blocks.stage_blocks(s)
        holds += [
            *(plan.first_units if s == 0 else ()),
            *(plan.last_units if s == num_stages - 1 else ()),
        ]
        got = stage.state_dict()
        assert set(got) == {k for k in full if _under(k, holds)} | shared, f"stage {s}"
        for key, value in got.items():
            assert torch.equal(value, full[key]), key
        seen |= set(got)
    assert seen == set(full)
    if build is Buffers:  # persistent buffers are saved by the stage holding them, others nowhere
        assert "blocks.0.gain" in stages[0].state_dict()
        assert "head.temperature" in stages[-1].state_dict()
        assert "head.temperature" not in stages[0].state_dict()
        assert all("scratch" not in k for s in stages for k in s.state_dict())
        assert shared == {"pos.table"}


# ------------------------------------------------------------------------------ known bugs
# Each of these is silently wrong today (see the report that added this file): the call split
# should either refuse the model or pipeline it exactly. strict=True: fixing one flips its test.
class MemoryBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.lin(h) + memory


class EncoderMemory(nn.Module):
    """Every block reads the encoder's output (like nn.TransformerDecoder's `memory`)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(D, D)
        self.blocks = nn.ModuleList(MemoryBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory, h = self.encoder(x), x
        for block in self.blocks:
            h = block(h, memory)
        return h


class LengthBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, rows: int) -> torch.Tensor:
        return self.lin(h) / rows


class IntFromBatch(nn.Module):
    """The blocks take a Python int computed from the batch (a length, a count)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(LengthBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.blocks:
            h = block(h, x.shape[0])
        return h


class ScalarSkip(nn.Module):
    """A value of the embedding's output crosses the blocks as a Python float (`.item()`)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(D, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        scale = h.detach().abs().max().item()
        for block in self.blocks:
            h = block(h)
        return h * scale


def _refused_or_exact(model: nn.Module, num_stages: int, example: tuple, args: tuple) -> None:
    try:
        _, inputs, stages = _stages(model, num_stages, example)
    except ValueError:
        return
    torch.testing.assert_close(_run(stages, inputs, args), model(*args), rtol=0, atol=1e-6)


@pytest.mark.parametrize("which", ["toy", "demo-transformer-4-layers"])
def test_block_arguments_from_outer_modules_reach_every_block_of_a_stage(which):
    torch.manual_seed(0)
    if which == "toy":
        x = (torch.randn(3, D),)
        _refused_or_exact(EncoderMemory(), 2, x, x)
    else:
        args = _seq2seq_batches()[0]
        _refused_or_exact(_demo_transformer(4), 2, args, args)


def test_python_block_arguments_follow_the_batch():
    torch.manual_seed(0)
    _refused_or_exact(IntFromBatch(), 2, (torch.randn(5, D),), (torch.randn(3, D),))


def test_a_skip_through_a_python_scalar_is_refused_or_exact():
    torch.manual_seed(0)
    x = (torch.randn(3, D),)
    _refused_or_exact(ScalarSkip(), 2, x, x)


# ------------------------------------------------------------------ optional and random arguments
class _MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        h = self.lin(h)
        if extra is None:
            return h
        return h.masked_fill(extra, 0.0) if extra.dtype == torch.bool else h + extra


class OptionalMask(nn.Module):
    """A mask computed from the model inputs, None when nothing is masked (as HF's causal LMs
    build none for an unpadded batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(D, D)
        self.blocks = nn.ModuleList(_MaskedBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x < -1.0
        mask = mask if bool(mask.any()) else None
        h = self.emb(x)
        for block in self.blocks:
            h = block(h, mask)
        return h


class Noisy(nn.Module):
    """Noise drawn before the blocks and given to each: the first stage's draw must be used."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(D, D)
        self.blocks = nn.ModuleList(_MaskedBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        noise = torch.randn(h.shape)
        for block in self.blocks:
            h = block(h, noise)
        return h


class OptionalMemory(nn.Module):
    """A block argument computed by an outer module, left out (None) for small batches."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mem = nn.Linear(D, D), nn.Linear(D, D)
        self.blocks = nn.ModuleList(_MaskedBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = self.mem(x) if x.shape[0] > 2 else None
        h = self.emb(x)
        for block in self.blocks:
            h = block(h, memory)
        return h


def _masked_rows(rows: int, masked: bool) -> torch.Tensor:
    x = torch.rand(rows, D)  # in [0, 1): nothing below -1
    if masked:
        x[0, :3] = -2.0
    return x


@pytest.mark.parametrize("example_masked", [True, False], ids=["masked-example", "unmasked"])
def test_a_mask_from_the_inputs_may_be_none_for_some_batches(example_masked):
    """Each stage computes an input-only argument itself, so a batch whose mask is None (or a
    tensor, where the checked example had None) runs exactly; only the hidden state is sent."""
    torch.manual_seed(0)
    model = OptionalMask()
    plan, inputs, stages = _stages(model, 2, (_masked_rows(3, example_masked),))
    assert plan.slots == (plan.slots[0],)  # the mask is never sent
    for masked in (True, False, True):
        x = _masked_rows(3, masked)
        torch.testing.assert_close(_run(stages, inputs, (x,)), model(x), rtol=0, atol=0)


def test_a_random_draw_before_the_blocks_is_sent_not_redrawn():
    torch.manual_seed(0)
    model = Noisy()
    x = torch.randn(3, D)
    plan, inputs, stages = _stages(model, 2, (x,))
    assert len(plan.slots) == 2 and not plan.local
    torch.manual_seed(1)
    want = model(x)
    torch.manual_seed(1)  # stage 0 draws what the model drew; stage 1's own draw is not used
    torch.testing.assert_close(_run(stages, inputs, (x,)), want, rtol=0, atol=0)


def test_a_sent_argument_that_becomes_none_is_a_clear_error():
    torch.manual_seed(0)
    model = OptionalMemory()
    plan, inputs, stages = _stages(model, 2, (torch.randn(3, D),))
    assert len(plan.slots) == 2  # the memory comes from an outer module: it is sent
    x = torch.randn(4, D)
    torch.testing.assert_close(_run(stages, inputs, (x,)), model(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"block argument 1 .* is None for this batch"):
        _run(stages, inputs, (torch.randn(2, D),))


def test_stubs_of_outer_modules_compute_in_the_mixed_precision_dtype():
    """Code between a stubbed embedding and the blocks reads its dtype (HF's rotary tables and
    float masks take it): under FSDP2 mixed precision the real one returns param_dtype."""
    model = OptionalMask()
    plan = plan_calls(model, plan_blocks(model, 2), (torch.rand(3, D),), {})
    stages = build_call_stages(model, plan, [1], CallInputs(), CPU, torch.bfloat16)
    assert stages[0].emb(torch.rand(3, D)).dtype == torch.bfloat16
    assert (
        build_call_stages(model, plan, [1], CallInputs(), CPU)[0].emb(torch.rand(3, D)).dtype
        == torch.float32
    )
