"""The HF adapter without a process group: building, splitting, the call adapter, export, errors."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_zeropp.core.split.blocks import find_blocks, plan_blocks
from lightning_zeropp.core.split.methods import split_model
from lightning_zeropp.fronts.call_adapter import CallAdapter, get_call_adapter, set_call_adapter
from lightning_zeropp.models.hf import (
    FAMILIES,
    build_causal_lm,
    export_hf,
    from_pretrained,
    prepare_causal_lm,
)
from lightning_zeropp.models.lit_causal_lm import LitCausalLM

pytest.importorskip("transformers")

TINY = {
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "max_position_embeddings": 32,
}


def _tokens(seed: int = 0, rows: int = 2, cols: int = 8) -> torch.Tensor:
    return torch.randint(
        0, TINY["vocab_size"], (rows, cols), generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_are_the_decoder_layers(family):
    model = build_causal_lm(family, seed=0, **TINY)
    assert find_blocks(model) == ("model.layers", ["0", "1", "2", "3"])
    assert model.config.tie_word_embeddings is False and model.config.use_cache is False
    assert model.lm_head.weight is not model.model.embed_tokens.weight


@pytest.mark.parametrize(("family", "num_stages"), [("llama", 2), ("qwen3", 4)])
def test_traced_stages_keep_hf_names_and_compose_to_the_model(family, num_stages):
    model = build_causal_lm(family, seed=0, **TINY)
    x, y = _tokens(0), _tokens(1)
    want = model(x, labels=x)
    plan = plan_blocks(model, num_stages)
    stages = split_model(model, plan, range(num_stages), "trace", example_args=(x,))
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert "model.layers.3.mlp.up_proj.weight" in dict(stages[-1].named_parameters())
    # Stage 0's rotary cos/sin and causal mask reach every later stage (relayed when > 2 stages).
    out: tuple = (x,)
    for stage in stages[:-1]:
        out = stage(*out)
        assert isinstance(out, tuple) and len(out) == 4
    logits = stages[-1](*out)  # the last stage returns the logits tensor itself
    torch.testing.assert_close(logits, want.logits, rtol=0, atol=1e-6)
    # The adapter's output on the last stage: HF-shaped, with the model's own loss.
    out = get_call_adapter(model).stage_output(logits, (x,), {"labels": x})
    torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=0)
    torch.testing.assert_close(out.loss, want.loss, rtol=0, atol=1e-6)
    # Pre-shifted targets: shift_labels are used as they are.
    shifted = get_call_adapter(model).stage_output(logits, (x,), {"labels": y, "shift_labels": y})
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    torch.testing.assert_close(shifted.loss, ce, rtol=0, atol=1e-6)
    assert get_call_adapter(model).stage_output(logits, (x,), {}).loss is None


def test_a_graph_traced_in_float32_is_refused_for_bf16_compute():
    """HF's norms cast to float32, a no-op when traced in float32: the graph checks it, and would
    fail on bf16 activations. Refused at the split, naming the fix (float32 compute traces:
    above; a model without such casts traces for bf16: test_core_parity's bf16 case)."""
    model = build_causal_lm("llama", seed=0, **TINY)
    plan = plan_blocks(model, 2)
    with pytest.raises(ValueError, match=r"activations are torch.float32.*Use split='call'"):
        split_model(model, plan, [0, 1], "trace", example_args=(_tokens(),), dtype=torch.bfloat16)


def test_adapter_feeds_the_first_stage_input_ids_only():
    adapter = get_call_adapter(build_causal_lm("llama", **TINY))
    x = _tokens()
    args, kwargs = adapter.stage_inputs((x,), {"labels": x, "shift_labels": x})
    assert args == (x,) and kwargs == {}
    args, kwargs = adapter.stage_inputs((), {"input_ids": x, "labels": x})
    assert args == (x,) and kwargs == {}
    with pytest.raises(
        ValueError,
        match=r"input_ids .* only; got 1 positional arguments and keywords \['attention_mask'\]",
    ):
        adapter.stage_inputs((x,), {"attention_mask": torch.ones_like(x)})


def test_identity_adapter_by_default_and_type_checked():
    model = torch.nn.Linear(2, 2)
    adapter = get_call_adapter(model)
    assert adapter.stage_inputs((1,), {"a": 2}) == ((1,), {"a": 2})
    assert adapter.stage_output("out", (), {}) == "out"
    with pytest.raises(TypeError, match="subclass CallAdapter"):
        set_call_adapter(model, object())  # type: ignore[arg-type]
    custom = CallAdapter()
    assert get_call_adapter(set_call_adapter(model, custom)) is custom
    assert "zeropp_call_adapter" not in model.state_dict()


def test_tied_embeddings_are_refused_or_untied():
    with pytest.raises(ValueError, match=r"tie_word_embeddings=True.*untie_embeddings=True"):
        build_causal_lm("qwen2", tie_word_embeddings=True, **TINY)
    model = build_causal_lm(
        "qwen2", seed=0, tie_word_embeddings=True, untie_embeddings=True, **TINY
    )
    head, emb = model.lm_head.weight, model.model.embed_tokens.weight
    assert head is not emb and head.data_ptr() != emb.data_ptr()
    torch.testing.assert_close(head, emb, rtol=0, atol=0)
    assert model.config.tie_word_embeddings is False


def test_unknown_family_and_non_hf_models_are_clear_errors():
    with pytest.raises(ValueError, match=r"family='gpt2' is not supported; use one of"):
        build_causal_lm("gpt2")
    with pytest.raises(TypeError, match="expects a transformers \\*ForCausalLM"):
        prepare_causal_lm(torch.nn.Linear(2, 2))


def test_export_round_trip_is_atomic(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_causal_lm("mistral", seed=0, **TINY)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["model.rotary_emb.inv_freq"] = torch.ones(4)  # a traced stage's buffer: dropped
    target = tmp_path / "hf"
    target.mkdir()
    (target / "stale.txt").write_text("previous export")
    export_hf(target, state, model.config)
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temp or old dir left behind
    assert json.loads((target / "config.json").read_text())["use_cache"] is True
    assert model.config.use_cache is False  # the live model's config is not touched
    loaded = AutoModelForCausalLM.from_pretrained(target, local_files_only=True)
    again = from_pretrained(target)
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)
        torch.testing.assert_close(again(x).logits, model(x).logits, rtol=0, atol=0)


def test_export_refuses_partial_state_and_tied_config(tmp_path):
    model = build_causal_lm("llama", **TINY)
    partial = {k: v for k, v in model.state_dict().items() if not k.startswith("lm_head")}
    with pytest.raises(RuntimeError, match=r"lacks 1 of the model's tensors.*lm_head.weight"):
        export_hf(tmp_path / "a", partial, model.config)
    assert list(tmp_path.iterdir()) == []
    model.config.tie_word_embeddings = True  # but embed_tokens and lm_head hold other values
    with pytest.raises(
        RuntimeError, match="'model.embed_tokens.weight' and 'lm_head.weight' differ"
    ):
        export_hf(tmp_path / "b", model.state_dict(), model.config)
    assert list(tmp_path.iterdir()) == []


def test_tied_export_writes_one_copy_and_loads_tied(tmp_path):
    """The pipelined copies of a tied weight (equal values, two names) export as HF saves a
    tied model: one tensor, and the loaded model ties the head back to it."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", tie_word_embeddings=True, **TINY)
    model = AutoModelForCausalLM.from_config(config)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # separate copies
    assert state["lm_head.weight"].data_ptr() != state["model.embed_tokens.weight"].data_ptr()
    export_hf(tmp_path / "hf", state, model.config)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)


def test_from_pretrained_needs_a_local_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        from_pretrained(tmp_path)


def test_lit_causal_lm_loss_paths_agree():
    model = build_causal_lm("llama", seed=0, **TINY)
    x, y = _tokens(0), _tokens(1)
    by_labels = LitCausalLM(model, micro_batch_size=2, seq_len=8, loss="labels")._loss((x, y))
    by_logits = LitCausalLM(model, micro_batch_size=2, seq_len=8, loss="logits")._loss((x, y))
    ce = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
    torch.testing.assert_close(by_labels, ce, rtol=0, atol=1e-6)
    torch.testing.assert_close(by_logits, ce, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"optimizer": "adam"}, r"optimizer='adam' is unknown"),
        ({"loss": "mse"}, r"loss='mse' is unknown"),
        ({"seq_len": 0}, r"seq_len=0 must be a positive int"),
    ],
)
def test_lit_causal_lm_validates_settings(kwargs, match):
    model = build_causal_lm("llama", **TINY)
    with pytest.raises(ValueError, match=match):
        LitCausalLM(model, **{"micro_batch_size": 2, "seq_len": 8, **kwargs})


def test_tied_checkpoint_loads_only_when_untied_explicitly(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", tie_word_embeddings=True, **TINY)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"tie_word_embeddings=True"):
        from_pretrained(tmp_path)
    model = from_pretrained(tmp_path, untie_embeddings=True)
    head, emb = model.lm_head.weight, model.model.embed_tokens.weight
    assert head is not emb and model.config.tie_word_embeddings is False
    torch.testing.assert_close(head, emb, rtol=0, atol=0)


def test_lit_causal_lm_exports_without_a_strategy(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_causal_lm("qwen2", seed=0, **TINY)
    LitCausalLM(model, micro_batch_size=2, seq_len=8).export_hf(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("example_padded", [True, False], ids=["padded-example", "unpadded"])
def test_call_stages_run_padded_and_unpadded_micro_batches_exactly(example_padded):
    """HF builds no attention mask for a micro-batch without padding: every stage computes the
    mask (and the rotary tables) from the micro-batch itself, so any mix of padded and unpadded
    micro-batches matches the model, whichever kind the split was checked with."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_zeropp.core.split.call_plan import CallInputs, plan_calls
    from lightning_zeropp.core.split.call_stages import build_call_stages

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **TINY, use_cache=False)
    model = AutoModelForCausalLM.from_config(config)

    def batch(padded: bool) -> dict[str, torch.Tensor]:
        mask = torch.ones(2, 8, dtype=torch.long)
        if padded:
            mask[1, 5:] = 0
        return {"input_ids": _tokens(int(padded)), "attention_mask": mask}

    plan = plan_calls(model, plan_blocks(model, 2), (), batch(example_padded))
    assert len(plan.slots) == 1  # the hidden state alone crosses the stage boundary
    inputs = CallInputs()
    stages = build_call_stages(model, plan, range(2), inputs, torch.device("cpu"))
    for padded in (True, False, True):
        kwargs = batch(padded)
        flat = inputs.flatten((), kwargs)
        logits = stages[1](*stages[0](**flat), **flat)[0]
        torch.testing.assert_close(logits, model(**kwargs).logits, rtol=0, atol=0)
