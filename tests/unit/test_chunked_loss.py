"""The head and the loss in chunks (`core.step.chunked_loss`): the same loss and gradients as whole
logits (fp32, 1e-6), and a last stage whose activation peak in the memory report drops."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.step import chunked_loss
from lightning_zeropp.core.step.chunked_loss import (
    DEFAULT_LOSS_CHUNK,
    chunk_for_run,
    linear_cross_entropy,
    set_loss_chunk,
)
from lightning_zeropp.models.gpt import GPT, GPTConfig

TOL = 1e-6


@pytest.fixture(autouse=True)
def keep_chunk() -> Iterator[None]:
    before = chunked_loss.loss_chunk()
    yield
    set_loss_chunk(before)


def _grads(module: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    module.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], atol=TOL, rtol=0), name


def test_linear_cross_entropy_equals_whole_logits_with_ignored_rows() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)
    hidden = torch.randn(3, 20, 16, requires_grad=True)
    target = torch.randint(0, 50, (3, 20))
    target[1] = -100  # a padded row
    target[2, 7:] = -100
    whole = F.cross_entropy(
        head(hidden).reshape(-1, 50).float(), target.reshape(-1), reduction="sum"
    )
    want = _grads(head, whole)
    want_input = torch.autograd.grad(
        F.cross_entropy(head(hidden).reshape(-1, 50), target.reshape(-1), reduction="sum"), hidden
    )[0]
    for chunk in (1, 7, 16, 59, 0):
        got_loss = linear_cross_entropy(hidden, head.weight, head.bias, target, chunk=chunk)
        assert abs(float(got_loss) - float(whole)) <= TOL * max(1.0, abs(float(whole)))
        _close(_grads(head, got_loss), want)
        got_input = torch.autograd.grad(
            linear_cross_entropy(hidden, head.weight, head.bias, target, chunk=chunk), hidden
        )[0]
        assert torch.allclose(got_input, want_input, atol=TOL, rtol=0)


@pytest.mark.parametrize("frozen", [False, True], ids=["trained-head", "frozen-head"])
def test_bf16_chunks_are_as_close_to_exact_as_whole_logits(frozen: bool) -> None:
    """In pieces, one of the head's gradients is a sum over them (`core.step.chunked_passes`):
    summed in bf16 over 8 token chunks, the weight's had 1.7x the whole logits' error here. Every
    gradient must stay within 1.25x of whole logits' own bf16 error; the oracle is fp64. A
    trained head is cut by vocabulary, a frozen one (LoRA) by tokens."""
    torch.manual_seed(0)
    tokens, dim, vocab = 512, 64, 1000
    hidden0, weight0 = torch.randn(tokens, dim), torch.randn(vocab, dim) * 0.05
    bias0, target = torch.randn(vocab) * 0.1, torch.randint(0, vocab, (tokens,))
    target[::9] = -100

    def grads(dtype: torch.dtype, chunk: int) -> list[torch.Tensor]:
        leaves = [
            t.to(dtype).requires_grad_(t is hidden0 or not frozen)
            for t in (hidden0, weight0, bias0)
        ]
        loss = linear_cross_entropy(*leaves, target, chunk=chunk) / tokens
        loss.backward()
        got = [t.grad.double() for t in leaves if t.grad is not None]
        return [loss.detach().double(), *got]

    exact = grads(torch.float64, 0)

    def errors(got: list[torch.Tensor]) -> list[float]:
        return [float((g - e).norm() / e.norm()) for g, e in zip(got, exact, strict=True)]

    whole, chunked = errors(grads(torch.bfloat16, 0)), errors(grads(torch.bfloat16, 64))
    assert len(whole) == (2 if frozen else 4)
    for name, w, c in zip(("loss", "hidden", "weight", "bias"), whole, chunked, strict=False):
        assert c <= 1.25 * w + 1e-7, (name, c, w)
    assert whole[1] > 1e-4  # bf16's rounding is there to compare (fp32 would be ~1e-7)


def test_a_target_outside_the_vocabulary_is_refused_as_whole_logits_refuse_it() -> None:
    hidden = torch.randn(8, 4, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(10, 4, dtype=torch.bfloat16, requires_grad=True)  # cut by vocabulary
    target = torch.tensor([1, 2, 3, 10, 4, 5, 6, -100])
    with pytest.raises(IndexError, match="target 10 is out of bounds for a vocabulary of 10"):
        linear_cross_entropy(hidden, weight, None, target, chunk=2)
    with pytest.raises(IndexError):
        F.cross_entropy(F.linear(hidden, weight).float(), target)


def test_the_bundled_gpt_loss_equals_whole_logits() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=300, seq_len=32, dim=32, num_heads=2, num_layers=2))
    x = torch.randint(0, 300, (4, 32))
    y = torch.randint(0, 300, (4, 32))
    y[1] = -100
    y[3, 5:] = -100
    logits = model(x)
    whole = F.cross_entropy(logits.reshape(-1, 300).float(), y.reshape(-1))
    want = _grads(model, whole)
    for chunk in (0, 8, 50):
        set_loss_chunk(chunk)
        loss = model(x, y)
        assert abs(float(loss) - float(whole)) <= TOL
        _close(_grads(model, loss), want)
    set_loss_chunk(8)
    y.fill_(-100)  # nothing labelled: 0 (not NaN), as the fronts' counted means give
    assert float(model(x, y)) == 0.0


def test_loss_chunk_is_a_checked_setting() -> None:
    assert ZeroPPConfig().resolve(1).loss_chunk is None  # 1024 where the run can chunk
    assert ZeroPPConfig(loss_chunk=0).resolve(1).loss_chunk == 0
    with pytest.raises(ValueError, match="loss_chunk=-1 must be a whole number"):
        ZeroPPConfig(loss_chunk=-1).resolve(1)
    with pytest.raises(ValueError, match="loss_chunk=-2 must be a whole number"):
        set_loss_chunk(-2)


def test_a_run_that_cannot_chunk_keeps_whole_logits_or_refuses_an_asked_chunk() -> None:
    """The call split (or one stage) chunks; a traced or pruned cut, or context parallelism,
    computes whole logits: unset (None) says so silently, a number asked for is refused."""
    assert chunk_for_run(None, "call", 4, 1) == DEFAULT_LOSS_CHUNK
    assert chunk_for_run(64, "call", 4, 1) == 64
    assert chunk_for_run(64, "trace", 1, 1) == 64  # one stage: the model's own call
    for split in ("trace", "stack"):
        assert chunk_for_run(None, split, 2, 1) == 0
        assert chunk_for_run(0, split, 2, 1) == 0
        with pytest.raises(ValueError, match=rf"loss_chunk=64 .* but split='{split}' hands the "):
            chunk_for_run(64, split, 2, 1)
    assert chunk_for_run(None, "call", 2, 2) == 0
    with pytest.raises(ValueError, match=r"loss_chunk=8 .* context parallelism \(cp_size=2\)"):
        chunk_for_run(8, "call", 2, 2)


def _first_step_activation_peak(chunk: int) -> int:
    """The bundled GPT's first training step through the engine on one process (its only stage
    is the last): the activation peak its memory report prints. Vocabulary 8k, 1k tokens (a larger
    head only takes longer: the logits dominate either way)."""
    from lightning_zeropp import launch_layout
    from lightning_zeropp.core.engine import ZeroPPEngine

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=8_000, seq_len=1024, dim=16, num_heads=2, num_layers=1)
    model = GPT(cfg)
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lambda out, _target: out  # noqa: E731
    config = ZeroPPConfig(pp_size=1, num_microbatches=1, loss_chunk=chunk)
    engine = ZeroPPEngine(model, launch_layout(config), loss_fn=loss_of)
    x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
    y = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
    engine.train_step(x, y, target=y)
    peak = engine.activation_peak
    assert peak is not None
    return peak


def test_the_last_stage_activation_peak_drops_with_chunks(group: None) -> None:
    whole = _first_step_activation_peak(0)
    chunked = _first_step_activation_peak(256)
    logits = 1024 * 8_000 * 4
    assert whole >= logits  # the whole-logits loss keeps its fp32 softmax for backward
    assert whole >= 2 * chunked, (whole, chunked)


def _llama() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=211,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("items", [None, 37.0])
def test_an_hf_llama_loss_with_padded_rows_equals_whole_logits(items: float | None) -> None:
    """HF's own loss (label shift, -100 rows, `num_items_in_batch` or the token mean) from the
    chunked head: the loss and every gradient of whole logits; logits whole when not armed."""
    from lightning_zeropp.fronts.hf_chunked import ChunkedHead, armed

    model = _llama()
    ids = torch.randint(0, 211, (3, 24))
    labels = ids.clone()
    labels[1] = -100  # a padded row
    labels[2, 10:] = -100
    kwargs = {} if items is None else {"num_items_in_batch": items}
    whole = model(input_ids=ids, labels=labels, **kwargs).loss
    want = _grads(model, whole)
    assert ChunkedHead.install(model)
    set_loss_chunk(5)
    with armed():
        out = model(input_ids=ids, labels=labels, **kwargs)
    assert out.logits.shape[-1] == 32  # the head's logits were never computed
    assert abs(float(out.loss) - float(whole)) <= TOL
    _close(_grads(model, out.loss), want)
    # not armed (evaluation, a step reading logits): the head computes logits as before
    assert model(input_ids=ids, labels=labels, **kwargs).logits.shape[-1] == 211


def test_a_head_whose_output_is_changed_before_the_loss_is_left_whole() -> None:
    from lightning_zeropp.fronts.hf_chunked import ChunkedHead

    model = _llama()
    model.config.final_logit_softcapping = 30.0
    assert not ChunkedHead.install(model)
    assert type(model.lm_head) is torch.nn.Linear


def test_a_forward_of_its_own_keeps_whole_logits_or_is_named() -> None:
    """A subclass's forward may read the logits itself (here: drops the labels and computes a
    mean from `out.logits`): not chunked; a forward that slips past is named at its step."""
    from lightning_zeropp.fronts.hf_chunked import ChunkedHead, armed, check_consumed
    from tests.distributed.clm_loop import OwnLossLlama

    own = OwnLossLlama(_llama().config)
    assert not ChunkedHead.install(own)
    model = _llama()
    assert ChunkedHead.install(model)
    ids = torch.randint(0, 211, (2, 8))
    with armed():
        model(input_ids=ids)  # no labels: the head's output was never given to the loss
        with pytest.raises(RuntimeError, match="did not pass the head's output to its loss"):
            check_consumed()


def test_litgpt_head_in_chunks_equals_whole_logits() -> None:
    """litgpt's GPT: its final hidden states (the input of its `lm_head`) through
    `linear_cross_entropy` give its whole-logits loss and gradients. (The library computes no
    litgpt loss itself: a LightningModule wrapping it computes its own loss over the logits,
    which keeps them whole.)"""
    from litgpt.config import Config
    from litgpt.model import GPT as LitGPTModel

    torch.manual_seed(0)
    config = Config(block_size=32, n_layer=2, n_embd=32, n_head=2, vocab_size=97)
    model = LitGPTModel(config)
    ids = torch.randint(0, 97, (3, 32))
    y = torch.randint(0, 97, (3, 32))
    y[0] = -100
    y[2, 4:] = -100
    logits = model(ids)
    vocab = logits.shape[-1]
    whole = F.cross_entropy(logits.reshape(-1, vocab).float(), y.reshape(-1))
    want = _grads(model, whole)
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
    model(ids)
    hook.remove()
    head = model.lm_head
    total = linear_cross_entropy(seen[0], head.weight, head.bias, y, chunk=7)
    loss = total / (y != -100).sum()
    assert abs(float(loss) - float(whole)) <= TOL
    _close(_grads(model, loss), want)


def test_a_split_backward_matches_whole_logits_and_its_weight_pass_reads_no_weight() -> None:
    """torch's split backward (as ZB-V and ZeroPP run it): the input pass, then the weight pass
    from the saved intermediates. The head's gradients are those of whole logits (1e-6), and the
    weight pass reads no weight value (ZeroPP's held-back weight tasks find it released)."""
    from lightning_zeropp.core._torch_private import stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)
    hidden = torch.randn(3, 20, 16)
    target = torch.randint(0, 50, (3, 20))
    target[1] = -100
    target[2, 7:] = -100
    whole_input = hidden.clone().requires_grad_(True)
    whole = F.cross_entropy(
        head(whole_input).reshape(-1, 50).float(), target.reshape(-1), reduction="sum"
    )
    want = _grads(head, whole)
    head.zero_grad()
    stage_input = hidden.clone().requires_grad_(True)
    loss = linear_cross_entropy(stage_input, head.weight, head.bias, target, chunk=7)
    assert abs(float(loss) - float(whole)) <= TOL * float(whole)
    (d_input,), groups = stage_backward_input([loss], None, [stage_input], head.parameters())
    assert torch.allclose(d_input, whole_input.grad, atol=TOL, rtol=0)
    assert head.weight.grad is None  # the input pass leaves the weights' to the weight pass
    values = head.weight.detach().clone()
    head.weight.data.fill_(float("nan"))  # released: read, it would poison the gradients
    stage_backward_weight(head.parameters(), groups)
    head.weight.data.copy_(values)
    _close({n: p.grad for n, p in head.named_parameters()}, want)  # type: ignore[misc]
