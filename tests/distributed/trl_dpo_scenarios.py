"""A TRL DPO script (prompt / chosen / rejected text rows, precomputed reference
log-probabilities) under `ZeroPPDPOTrainer` and under TRL's own `DPOTrainer` in one process;
and the refusals, each on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer

from lightning_zeropp.transformers import ZeroPPPlugin
from tests.distributed.trainer_script import LORA_TARGETS, TINY, VOCAB, Recorder


def tokenizer() -> PreTrainedTokenizerFast:
    """Words t2..t63 are their ids; `</s>` (1) ends a completion, `<pad>` (0) pads."""
    vocab = {"<pad>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    words = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="</s>")


def rows(n: int, seed: int) -> Dataset:
    """Preference rows as TRL's examples write them: a prompt of 2..4 words, a chosen and a
    rejected completion of 1..6 words each."""
    g = torch.Generator().manual_seed(seed)

    def words(low: int, high: int) -> str:
        length = int(torch.randint(low, high, (), generator=g))
        return " ".join(f"t{int(i)}" for i in torch.randint(2, VOCAB, (length,), generator=g))

    data: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(n):
        data["prompt"].append(words(2, 5))
        data["chosen"].append(" " + words(1, 7))
        data["rejected"].append(" " + words(1, 7))
    return Dataset.from_dict(data)


def _lora(**overrides: Any) -> Any:
    """LoRA adapters as TRL's examples pass them (trl/scripts/dpo.py: get_peft_config)."""
    from peft import LoraConfig

    kwargs = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": LORA_TARGETS}
    return LoraConfig(task_type="CAUSAL_LM", **{**kwargs, **overrides})


def _trainer(case: dict[str, Any], folder: Path, recorder: Recorder) -> Any:
    if case.get("eval"):  # TRL's evaluation after steps 2 and 3, of 8 pairs (or eval_pairs)
        extra = {
            "eval_strategy": "steps",
            "eval_steps": 2,
            "per_device_eval_batch_size": case["batch"],
        }
        case = {**case, "args": {**extra, **case.get("args", {})}}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(
            "llama", **TINY, tie_word_embeddings=False, **case.get("model_config", {})
        )
    )
    if case.get("from_path"):  # TRL loads its per-step reference model from the policy's path
        distributed = torch.distributed.is_initialized()
        if not distributed or torch.distributed.get_rank() == 0:
            model.save_pretrained(folder / "initial")
        if distributed:
            torch.distributed.barrier()
        model = AutoModelForCausalLM.from_pretrained(folder / "initial")
    args = DPOConfig(
        output_dir=str(folder),
        per_device_train_batch_size=case["batch"],
        # SGD: the weights are the gradients' sum (Adam's first steps would blow up the float
        # noise of a gradient element near zero into a weight difference of about lr)
        optim="sgd",
        learning_rate=0.5,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_length=32,
        **{
            "save_strategy": "no",
            "beta": 0.5,
            "max_steps": 3,
            "precompute_ref_log_probs": True,
            "precompute_ref_batch_size": 4,
            "gradient_accumulation_steps": case.get("accumulation", 1),
            **case.get("args", {}),
        },
    )
    kwargs: dict[str, Any] = dict(case.get("init", {}))
    if case.get("eval"):
        kwargs["eval_dataset"] = rows(case.get("eval_pairs", 8), 2)
    if kwargs.get("eval_dataset") == "rows":
        kwargs["eval_dataset"] = rows(8, 2)
    if kwargs.get("ref_model") == "deeper":  # two layers more than the policy's
        deeper = {**TINY, "num_hidden_layers": TINY["num_hidden_layers"] + 2}
        kwargs["ref_model"] = AutoModelForCausalLM.from_config(
            AutoConfig.for_model("llama", **deeper, tie_word_embeddings=False)
        )
    if kwargs.get("peft_config") is not None:
        kwargs["peft_config"] = _lora(**kwargs["peft_config"])
    if kwargs.get("model") == "peft":  # a PeftModel passed in (TRL then adds a "ref" adapter)
        from peft import get_peft_model

        model = get_peft_model(model, _lora())
        del kwargs["model"]
    if kwargs.get("ref_model") == "same":
        kwargs["ref_model"] = AutoModelForCausalLM.from_config(model.config)
    cls: Any = DPOTrainer
    if case.get("plugin") is not None:
        from lightning_zeropp.trl import ZeroPPDPOTrainer

        cls = ZeroPPDPOTrainer
        kwargs["zeropp_plugin"] = ZeroPPPlugin(**case["plugin"])
    return cls(
        model=model,
        args=args,
        train_dataset=rows(48, 1),
        processing_class=tokenizer(),
        callbacks=[recorder],
        **kwargs,
    )


def run(cases: list[dict[str, Any]], out_dir: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for case in cases:
        folder = Path(out_dir) / case["id"]
        recorder = Recorder()
        if case.get("refused"):
            try:
                refused = _trainer(case, folder, recorder)
                if case["refused"] == "train":
                    refused.train()
                if case["refused"] == "evaluate":  # the second once the pipeline is built
                    refused.evaluate(rows(8, 2))
                    refused.evaluate(rows(8, 2))
                if case["refused"] == "predict":
                    refused.predict(rows(8, 2))
            except ValueError as err:
                results[case["id"]] = {"error": str(err)}
                continue
            results[case["id"]] = {"error": None}
            continue
        trainer = _trainer(case, folder, recorder)
        out = _trained(trainer, folder / "final", recorder.logs)
        if case.get("resume"):  # a new trainer (as a new process) from checkpoint-<resume>
            recorder = Recorder()
            trainer = _trainer(case, folder, recorder)
            checkpoint = str(folder / f"checkpoint-{case['resume']}")
            resumed = _trained(
                trainer, folder / "resumed", recorder.logs, resume_from_checkpoint=checkpoint
            )
            out = {**resumed, "uninterrupted": out}
        results[case["id"]] = out
    return results


def _trained(trainer: Any, folder: Path, logs: list, **train: Any) -> dict[str, Any]:
    """`trainer` trained and saved in `folder`: its logs and (rank 0) the saved weights."""
    trainer.train(**train)
    trainer.save_model(str(folder))
    out: dict[str, Any] = {"logs": logs}
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        adapter = folder / "adapter_model.safetensors"
        if adapter.exists():
            from safetensors.torch import load_file

            out["weights"] = load_file(str(adapter))
        else:
            saved = AutoModelForCausalLM.from_pretrained(folder)
            out["weights"] = {k: v.clone() for k, v in saved.state_dict().items()}
    trainer.accelerator.free_memory()
    return out
