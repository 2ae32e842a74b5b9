"""The transformers front and packed batches without a process group: what `ZeroPPTrainer`
refuses at construction (before any process group), how `bf16=True` maps, and the reshaping of
packed and padded batches, checked against an HF model computing the batch as given."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    TrainingArguments,
)

from lightning_zeropp.fronts.packing import bucket_length, check_buckets, reshape  # noqa: E402
from lightning_zeropp.transformers import ZeroPPPlugin, ZeroPPTrainer  # noqa: E402
from lightning_zeropp.transformers.settings import plugin_for  # noqa: E402

REFUSED = [
    ({"torch_compile": True}, "torch_compile"),
    # mapped onto the library's, except what it cannot do
    (
        {
            "activation_checkpointing": True,
            "activation_checkpointing_kwargs": {"every_n_layers": 2},
        },
        "activation_checkpointing_kwargs={'every_n_layers': 2}",
    ),
    ({"auto_find_batch_size": True}, "auto_find_batch_size"),
    ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha"),
    ({"average_tokens_across_devices": False}, "average_tokens_across_devices"),
    ({"train_sampling_strategy": "batch_rebalance"}, "batch_rebalance"),
    ({"save_on_each_node": True}, "save_on_each_node"),
    ({"bf16_full_eval": True}, "bf16_full_eval"),
]


def _model() -> torch.nn.Module:
    config = AutoConfig.for_model(
        "llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(("setting", "named"), REFUSED, ids=[str(s) for s, _ in REFUSED])
def test_refused_at_construction(tmp_path, setting, named):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    for key, value in setting.items():
        setattr(args, key, value)  # past TrainingArguments' own checks, which some hit on CPU
    with pytest.raises(ValueError, match="ZeroPPTrainer") as err:
        ZeroPPTrainer(model=torch.nn.Linear(2, 2), args=args)
    assert named in str(err.value)
    assert not torch.distributed.is_initialized()  # refused before any process group


def test_every_optim_is_tested_or_refused_naming_why(tmp_path):
    """Before: optim="adafactor" crashed at the first step with a DTensor error."""
    from transformers.training_args import OptimizerNames

    from lightning_zeropp.transformers.settings import TESTED_OPTIMS

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    for name in OptimizerNames:
        args.optim = name  # past TrainingArguments' checks (some need packages not installed)
        if name.value in TESTED_OPTIMS:
            continue  # test_trainer.py runs them against one process
        with pytest.raises(ValueError, match=f"ZeroPPTrainer: optim='{name.value}'") as err:
            ZeroPPTrainer(model=torch.nn.Linear(2, 2), args=args)
        assert "adamw_torch" in str(err.value)  # what to use instead
        if name.value == "adafactor":
            assert "factorizes each weight matrix's second moment" in str(err.value)
    args.optim = OptimizerNames.ADAFACTOR  # not the Trainer's optimizer: allowed
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    ZeroPPTrainer(model=torch.nn.Linear(2, 2), args=args, optimizers=(opt, None))


def test_fp16_and_model_init_refused(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    args.fp16 = True
    with pytest.raises(ValueError, match="bf16=True"):
        ZeroPPTrainer(model=torch.nn.Linear(2, 2), args=args)
    args.fp16 = False
    with pytest.raises(ValueError, match="model_init"):
        ZeroPPTrainer(args=args, model_init=lambda: torch.nn.Linear(2, 2))


def test_gradient_checkpointing_is_the_librarys(tmp_path):
    """Before: refused, naming activation_checkpointing (TRL's SFTConfig sets it by default)."""
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    args.gradient_checkpointing = args.activation_checkpointing = True
    config = plugin_for(ZeroPPPlugin(pp_size=2), args).run_settings().config
    assert config.activation_checkpointing is True
    assert not args.gradient_checkpointing and not args.activation_checkpointing  # not patched
    args.gradient_checkpointing = args.activation_checkpointing = True
    kept = plugin_for(ZeroPPPlugin(pp_size=2, activation_checkpointing="except_last"), args)
    assert kept.run_settings().config.activation_checkpointing == "except_last"


def test_checkpointing_with_offload_is_the_librarys_offload(tmp_path):
    """Before: activation_checkpointing_kwargs={'offload': True} was refused; now every stage
    also offloads its saved activations (`offload_activations=True`), unless the plugin says."""
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    args.activation_checkpointing, args.activation_checkpointing_kwargs = True, {"offload": True}
    config = plugin_for(ZeroPPPlugin(pp_size=2), args).run_settings().config
    assert config.activation_checkpointing is True and config.offload_activations is True
    args.activation_checkpointing = True
    ranks = plugin_for(ZeroPPPlugin(pp_size=2, offload_activations=[0]), args)
    assert ranks.run_settings().config.offload_activations == [0]
    args.activation_checkpointing, args.activation_checkpointing_kwargs = True, None
    plain = plugin_for(ZeroPPPlugin(pp_size=2), args).run_settings().config
    assert plain.offload_activations is False


def test_bf16_is_fsdp_mixed_precision(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    args.bf16 = True
    plugin = plugin_for(ZeroPPPlugin(pp_size=2, seq_buckets=8), args)
    config = plugin.run_settings().config
    assert config.param_dtype == torch.bfloat16 and config.reduce_dtype == torch.float32
    assert config.pp_size == 2 and plugin.seq_buckets == 8
    with pytest.raises(ValueError, match="disagree"):
        plugin_for(ZeroPPPlugin(param_dtype="fp16"), args)


def test_buckets():
    assert [bucket_length(n, "pow2") for n in (1, 5, 8, 9)] == [1, 8, 8, 16]
    assert [bucket_length(n, 8) for n in (3, 8, 9)] == [8, 8, 16]
    assert [bucket_length(n, [16, 64]) for n in (3, 17, 65)] == [16, 64, 65]
    assert bucket_length(7, None) == 7
    for bad in ("pow3", 0, [], [0], True):
        with pytest.raises(ValueError, match="seq_buckets"):
            check_buckets(bad)


def _packed(lengths: list[int], seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    features = [{"input_ids": torch.randint(1, 64, (n,), generator=g).tolist()} for n in lengths]
    return DataCollatorWithFlattening()(features)


@pytest.mark.parametrize(("rows", "buckets"), [(2, None), (4, "pow2"), (3, 8)])
def test_packed_rows_regrouped_exactly(rows, buckets):
    """Regrouped into `rows` runs of whole documents: the loss over the labelled tokens and
    every real token's logits are the packed row's; the gradients too."""
    model = _model()
    batch = _packed([7, 3, 11, 5, 9, 4])
    reference = model(**batch)
    reference.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    shaped = reshape(batch, rows, buckets)
    assert shaped.batch["input_ids"].shape[0] == rows
    count = (shaped.batch["labels"][:, 1:] != -100).sum()
    assert count == (batch["labels"][:, 1:] != -100).sum()
    out = model(**shaped.batch, num_items_in_batch=count)
    out.loss.backward()
    torch.testing.assert_close(out.loss, reference.loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(shaped.restore(out.logits), reference.logits, rtol=0, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=1e-6, msg=name)


def test_padding_to_a_bucket_is_exact():
    model = _model()
    ids = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    reference = model(**batch)
    shaped = reshape(batch, 3, "pow2")
    assert shaped.batch["input_ids"].shape == (3, 8)
    out = model(**shaped.batch)
    torch.testing.assert_close(out.loss, reference.loss, rtol=0, atol=1e-6)
    real = mask.bool()
    torch.testing.assert_close(
        shaped.restore(out.logits)[real], reference.logits[real], rtol=0, atol=1e-5
    )


def test_packed_batches_that_cannot_be_regrouped():
    batch = _packed([4, 5])
    with pytest.raises(ValueError, match="return_flash_attn_kwargs"):
        reshape({**batch, "cu_seq_lens_q": torch.tensor([0, 4, 9])}, 2, None)
    labels = batch["labels"].clone()
    labels[0, 4] = 7  # the second document's first label is a target of the first's last token
    with pytest.raises(ValueError, match="separator_id=-100"):
        reshape({**batch, "labels": labels}, 2, None)
    with pytest.raises(ValueError, match="weights"):
        reshape({**batch, "weights": torch.ones_like(labels)}, 2, None)
    # rows that already split into the micro-batches are left as they are
    assert reshape(batch, 1, None).batch is batch


def test_released_model_says_where_its_weights_are(tmp_path):
    """After the pipeline is built the model passed in holds no weights: saving it (a PEFT
    script's closing `model.save_pretrained`, or a merge's) names the calls that save the
    trained weights, instead of failing on a meta tensor; once the weights are back
    (`unwrap_model` puts them into this model on the main process), it saves as usual."""
    from peft import LoraConfig, get_peft_model

    from lightning_zeropp.transformers import release_weights

    def peft_model() -> torch.nn.Module:
        return get_peft_model(_model(), LoraConfig(r=2, target_modules=["q_proj"]))

    model = peft_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    release_weights(model)
    with pytest.raises(RuntimeError, match=r"trainer\.save_model\(dir\)"):
        model.save_pretrained(tmp_path / "adapter")
    model.load_state_dict(state, assign=True)
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    released = peft_model()
    release_weights(released)
    with pytest.raises(RuntimeError, match="unwrap_model"):
        released.merge_and_unload().save_pretrained(tmp_path / "merged")


def test_save_pretrained_at_pp1_takes_a_state_dict_passed_by_position(tmp_path):
    """The pp 1 stage's `save_pretrained` (its weights shards) writes a `state_dict` given by
    position as by keyword (HF's third parameter), and is refused without one."""
    from lightning_zeropp.transformers.release import _refusing_save_pretrained

    calls = []

    class Sharded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(2, device="meta"))

        def save_pretrained(self, save_directory, is_main_process=True, state_dict=None):
            calls.append(state_dict)

    model, whole = Sharded(), {"w": torch.ones(2)}
    _refusing_save_pretrained(model, str(tmp_path), True, whole)
    _refusing_save_pretrained(model, str(tmp_path), state_dict=whole)
    assert calls == [whole, whole]
    with pytest.raises(RuntimeError, match="pipeline's only stage"):
        _refusing_save_pretrained(model, str(tmp_path), True)
