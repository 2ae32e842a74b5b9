"""A TRL SFT script (tokenized prompt-completion rows, completion-only loss; or packed rows)
under `ZeroPPSFTTrainer` and under TRL's own `SFTTrainer` in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
from trl import SFTConfig, SFTTrainer

from lightning_zeropp.transformers import ZeroPPPlugin
from tests.distributed.trainer_script import LORA_TARGETS, TINY, Recorder, tokenizer


def rows(n: int, seed: int) -> Dataset:
    """Tokenized rows of 4..12 tokens, the first 2..4 of them the prompt."""
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for _ in range(n):
        length = int(torch.randint(4, 13, (), generator=g))
        prompt = int(torch.randint(2, 5, (), generator=g))
        ids.append(torch.randint(1, 64, (length,), generator=g).tolist())
        masks.append([0] * prompt + [1] * (length - prompt))
    return Dataset.from_dict({"input_ids": ids, "completion_mask": masks})


def _lora() -> Any:
    from peft import LoraConfig

    # as TRL's SFT examples write it (trl/scripts/sft.py: get_peft_config)
    return LoraConfig(
        task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS
    )


def _trainer(case: dict[str, Any], folder: Path, recorder: Recorder) -> Any:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama", **TINY, tie_word_embeddings=False)
    )
    settings: dict[str, Any] = {
        "output_dir": str(folder),
        "per_device_train_batch_size": case["batch"],
        "learning_rate": 3e-3,
        "max_steps": 3,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "bf16": False,
        "save_strategy": "no",
        "max_length": 32,
        "per_device_eval_batch_size": case["batch"],
    }
    args = SFTConfig(**{**settings, **case.get("args", {})})
    kwargs: dict[str, Any] = {}
    cls: Any = SFTTrainer
    if case.get("plugin") is not None:
        from lightning_zeropp.trl import ZeroPPSFTTrainer

        cls = ZeroPPSFTTrainer
        kwargs["zeropp_plugin"] = ZeroPPPlugin(**case["plugin"])
    return cls(
        model=model,
        args=args,
        train_dataset=rows(48, 1),
        eval_dataset=rows(case.get("eval_rows", 8), 2) if case.get("eval") else None,
        processing_class=tokenizer(),
        callbacks=[recorder],
        peft_config=_lora() if case.get("lora") else None,
        **kwargs,
    )


def _weights(case: dict[str, Any], folder: Path) -> dict[str, torch.Tensor]:
    if case.get("lora"):  # the adapters, as saved
        return load_file(folder / "adapter_model.safetensors")
    saved = AutoModelForCausalLM.from_pretrained(folder)
    return {k: v.clone() for k, v in saved.state_dict().items()}


def run(cases: list[dict[str, Any]], out_dir: str) -> dict[str, Any]:
    """Each case trained `max_steps` and saved; a `resume` case then trained again by a new
    trainer (a new process would do the same) from `checkpoint-<resume>`: its logs and weights
    are the resumed run's, `uninterrupted` the first run's."""
    results = {}
    first = torch.distributed.is_initialized() is False or torch.distributed.get_rank() == 0
    for case in cases:
        folder = Path(out_dir) / case["id"]
        recorder = Recorder()
        trainer = _trainer(case, folder, recorder)
        trainer.train()
        trainer.save_model(str(folder / "final"))
        out: dict[str, Any] = {"logs": recorder.logs}
        if first:
            out["weights"] = _weights(case, folder / "final")
        trainer.accelerator.free_memory()
        if case.get("resume"):
            out = {"uninterrupted": out}
            recorder = Recorder()
            trainer = _trainer(case, folder, recorder)
            trainer.train(resume_from_checkpoint=str(folder / f"checkpoint-{case['resume']}"))
            trainer.save_model(str(folder / "resumed"))
            out["logs"] = recorder.logs
            if first:
                out["weights"] = _weights(case, folder / "resumed")
            trainer.accelerator.free_memory()
        results[case["id"]] = out
    return results
