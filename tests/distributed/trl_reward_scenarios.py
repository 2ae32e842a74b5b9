"""A TRL reward-model script (tokenized chosen/rejected pairs, a sequence-classification model
with `num_labels=1`) under `ZeroPPRewardTrainer` and under TRL's own `RewardTrainer` in one
process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForSequenceClassification
from trl import RewardConfig, RewardTrainer

from lightning_zeropp.transformers import ZeroPPPlugin
from tests.distributed.trainer_script import TINY, Recorder, tokenizer


def pairs(n: int, seed: int, margin: bool) -> Dataset:
    """Tokenized pairs of 3..10 tokens each (the rows padded unevenly), with a margin column."""
    g = torch.Generator().manual_seed(seed)
    columns: dict[str, list[Any]] = {"chosen_ids": [], "rejected_ids": []}
    for _ in range(n):
        for key in ("chosen_ids", "rejected_ids"):
            length = int(torch.randint(3, 11, (), generator=g))
            columns[key].append(torch.randint(1, 64, (length,), generator=g).tolist())
    if margin:
        columns["margin"] = (torch.rand(n, generator=g) * 2 - 0.5).tolist()
    return Dataset.from_dict(columns)


def _lora() -> Any:
    from peft import LoraConfig

    # TRL's advice for a reward model: the score head trained in full beside the adapters
    return LoraConfig(
        task_type="SEQ_CLS",
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        modules_to_save=["score"],
    )


def _trainer(case: dict[str, Any], folder: Path, recorder: Recorder) -> Any:
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **TINY, num_labels=1)
    model = AutoModelForSequenceClassification.from_config(config)
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
        "per_device_eval_batch_size": case["batch"],
    }
    args = RewardConfig(**{**settings, **case.get("args", {})})
    kwargs: dict[str, Any] = {}
    cls: Any = RewardTrainer
    if case.get("plugin") is not None:
        from lightning_zeropp.trl import ZeroPPRewardTrainer

        cls = ZeroPPRewardTrainer
        kwargs["zeropp_plugin"] = ZeroPPPlugin(**case["plugin"])
    return cls(
        model=model,
        args=args,
        train_dataset=pairs(case.get("pairs", 48), 1, case.get("margin", False)),
        eval_dataset=pairs(case.get("eval_pairs", 8), 2, False) if case.get("evaluate") else None,
        processing_class=tokenizer(),
        callbacks=[recorder],
        peft_config=_lora() if case.get("lora") else None,
        **kwargs,
    )


def _trained(case: dict[str, Any], trainer: Any, folder: Path, logs: list, **train: Any) -> dict:
    """`trainer` trained and saved under `folder`: its logs and (rank 0) saved weights."""
    trainer.train(**train)
    trainer.save_model(str(folder))
    out: dict[str, Any] = {"logs": logs}
    if torch.distributed.is_initialized() is False or torch.distributed.get_rank() == 0:
        if case.get("lora"):  # the adapters (and the score head PEFT keeps), as saved
            out["weights"] = load_file(folder / "adapter_model.safetensors")
        else:
            saved = AutoModelForSequenceClassification.from_pretrained(folder)
            out["weights"] = {k: v.clone() for k, v in saved.state_dict().items()}
    trainer.accelerator.free_memory()
    return out


def run(cases: list[dict[str, Any]], out_dir: str) -> dict[str, Any]:
    """Each case trained `max_steps` and saved; a `resume` case then trained again by a new
    trainer (a new process would do the same) from `checkpoint-<resume>`: its logs and weights
    are the resumed run's, `uninterrupted` the first run's."""
    results = {}
    for case in cases:
        folder = Path(out_dir) / case["id"]
        recorder = Recorder()
        try:
            trainer = _trainer(case, folder, recorder)
        except (NotImplementedError, ValueError) as err:  # refused at construction
            results[case["id"]] = {"error": str(err)}
            continue
        if case.get("expect_error"):  # a refusal: its message, from every rank
            try:
                if case.get("predict"):
                    trainer.predict(pairs(8, 2, False))
                trainer.train()
            except (ValueError, NotImplementedError) as err:
                results[case["id"]] = {"error": str(err)}
                continue
            raise AssertionError(f"{case['id']}: nothing was refused")
        out = _trained(case, trainer, folder / "final", recorder.logs)
        if case.get("resume"):
            recorder = Recorder()
            trainer = _trainer(case, folder, recorder)
            checkpoint = str(folder / f"checkpoint-{case['resume']}")
            resumed = _trained(
                case, trainer, folder / "resumed", recorder.logs, resume_from_checkpoint=checkpoint
            )
            out = {**resumed, "uninterrupted": out}
        results[case["id"]] = out
    return results
