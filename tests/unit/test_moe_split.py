"""Mixture-of-experts models under split="call": exact, or refused naming why.

HF's MoE families (Mixtral, Qwen2-MoE, OLMoE) record every layer's router logits with hooks inside
the layers and compute the load-balancing loss from all of them after the last layer. Under the
call split, a stage runs its own layers only: the last stage saw only its layers' router logits
(aux_loss 2.0091 against 2.0019 in one process, the first stage's routers got no aux gradient),
unsaid. Such a read is refused at setup; without router logits the families pipeline exactly.
"""

from __future__ import annotations

import pytest
import torch

from lightning_zeropp.core.split.blocks import plan_blocks
from lightning_zeropp.core.split.call_plan import CallInputs, plan_calls
from lightning_zeropp.core.split.call_stages import build_call_stages
from lightning_zeropp.core.split.outputs import restore_output

transformers = pytest.importorskip("transformers")

COMMON = {
    "use_cache": False,
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "num_experts_per_tok": 2,
}


def _mixtral(router: bool):
    cfg = transformers.MixtralConfig(num_local_experts=4, output_router_logits=router, **COMMON)
    return transformers.MixtralForCausalLM(cfg)


def _qwen2_moe(router: bool):
    cfg = transformers.Qwen2MoeConfig(
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        output_router_logits=router,
        **COMMON,
    )
    return transformers.Qwen2MoeForCausalLM(cfg)


def _olmoe(router: bool):
    cfg = transformers.OlmoeConfig(num_experts=4, output_router_logits=router, **COMMON)
    return transformers.OlmoeForCausalLM(cfg)


FAMILIES = [_mixtral, _qwen2_moe, _olmoe]
IDS = ["mixtral", "qwen2-moe", "olmoe"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py


def _batch() -> dict[str, torch.Tensor]:
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    return {"input_ids": x, "labels": x}


@pytest.mark.parametrize("build", FAMILIES, ids=IDS)
def test_router_logits_read_after_the_layers_are_refused(build):
    torch.manual_seed(0)
    model = build(router=True)
    with pytest.raises(ValueError, match=r"inside block 0 and not returned by it") as err:
        plan_calls(model, plan_blocks(model, 2), (), _batch())
    assert "output_router_logits" in str(err.value)


@pytest.mark.parametrize("build", FAMILIES, ids=IDS)
def test_without_router_logits_the_stages_match_the_model(build):
    torch.manual_seed(0)
    model = build(router=False)
    batch = _batch()
    plan = plan_calls(model, plan_blocks(model, 2), (), batch)
    inputs = CallInputs()
    stages = build_call_stages(model, plan, range(2), inputs, torch.device("cpu"))
    flat = inputs.flatten((), batch)
    sent = stages[0](**flat)
    got = restore_output(stages[1], stages[1](*sent, **flat)).loss
    want = model(**batch).loss
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    got.backward()
    want.backward()
    for stage in stages:
        for name, param in stage.named_parameters():
            expected = model.get_parameter(name).grad
            if expected is None:  # an expert no token was routed to
                assert param.grad is None or not param.grad.any(), name
                continue
            torch.testing.assert_close(param.grad, expected, rtol=0, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------ (x, aux) blocks
class MoEBlock(torch.nn.Module):
    """A soft mixture of 4 experts returning `(x, aux)`: aux is the load-balancing term of the
    rows it saw (a batch-level statistic: the mean routing probability per expert)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(16, 4)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.gate(x).softmax(-1)
        y = sum(p[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))
        return x + y, (p.mean((0, 1)) ** 2).sum() * 4


class MoEModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(MoEBlock() for _ in range(4))
        self.head = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, total = self.emb(x), 0.0
        for block in self.blocks:
            h, aux = block(h)
            total = total + aux
        return self.head(h), total


@pytest.mark.parametrize("num_stages", [2, 3])
def test_blocks_returning_an_aux_loss_are_carried_by_the_call_split(num_stages):
    """Each stage sends its blocks' aux values on with the hidden state; an earlier block's
    stand-in returns the received one, so the model's own `total = total + aux` runs on the
    last stage and every router gets its aux gradient back (before: refused)."""
    torch.manual_seed(0)
    model = MoEModel()
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(3))
    plan = plan_calls(model, plan_blocks(model, num_stages), (x,), {})
    assert plan.aux == (1,)
    inputs = CallInputs()
    stages = build_call_stages(model, plan, range(num_stages), inputs, torch.device("cpu"))
    flat = inputs.flatten((x,), {})
    sent: tuple = ()
    for stage in stages:
        sent = stage(*sent, **flat)
    logits, total = sent
    want_logits, want_total = model(x)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(total, want_total, rtol=0, atol=1e-6)
    (logits.square().mean() + 0.01 * total).backward()
    (want_logits.square().mean() + 0.01 * want_total).backward()
    for stage in stages:
        for name, param in stage.named_parameters():
            want = model.get_parameter(name).grad
            torch.testing.assert_close(param.grad, want, rtol=0, atol=1e-6, msg=name)


class HiddenReadModel(MoEModel):
    """Reads an earlier block's hidden state after the blocks: still refused."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, total = self.emb(x), 0.0
        for block in self.blocks:
            h, aux = block(h)
            total = total + aux + h.mean()
        return self.head(h), total


def test_an_earlier_blocks_hidden_state_read_after_the_blocks_is_refused():
    model = HiddenReadModel()
    x = torch.randint(0, 32, (2, 8))
    with pytest.raises(ValueError, match=r"reads a value computed from block 0's output"):
        plan_calls(model, plan_blocks(model, 2), (x,), {})


class NoAuxBlock(MoEBlock):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        return super().forward(x)[0], None


class NoAuxFirst(MoEModel):
    """Block 0 returns `(x, None)`: an extra value that is not a tensor for every block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[0] = NoAuxBlock()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, total = self.emb(x), 0.0
        for block in self.blocks:
            h, aux = block(h)
            total = total if aux is None else total + aux
        return self.head(h), total


def test_an_extra_return_that_is_not_always_a_tensor_is_refused():
    model = NoAuxFirst()
    x = torch.randint(0, 32, (2, 8))
    with pytest.raises(ValueError, match=r"block 0 returns NoneType at position 1"):
        plan_calls(model, plan_blocks(model, 2), (x,), {})


def test_traced_aux_loss_is_the_micro_batchs_own():
    """Under split='trace' the stages carry every block's aux to the last one: a micro-batch's
    output (logits and aux) is the model's on that micro-batch, which is what one process
    accumulating micro-batches computes (not the full batch's aux)."""
    from lightning_zeropp.core.split.methods import split_model

    torch.manual_seed(0)
    model = MoEModel()
    batch = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(2))
    micro = batch[:2]
    stages = split_model(model, plan_blocks(model, 2), [0, 1], "trace", (micro,))
    sent = stages[0](micro)
    logits, aux = stages[1](*(sent if isinstance(sent, tuple) else (sent,)))
    want_logits, want_aux = model(micro)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(aux, want_aux, rtol=0, atol=1e-6)
    # ... which is not the whole batch's statistic
    assert (aux - model(batch)[1]).abs() > 1e-6
