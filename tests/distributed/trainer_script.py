"""A causal-LM fine-tuning script in the shape HF users write for `transformers.Trainer`.

A model from a config, a tokenizer, a dataset of dicts (`{"input_ids": [...]}`), HF's usual
collator (`DataCollatorForLanguageModeling(mlm=False)`, or `DataCollatorWithFlattening` for
packed rows), `TrainingArguments`, `compute_metrics`, a callback, `train()`, `evaluate()`,
`predict()` and `save_model()`. The trainer class is passed in, so the same script runs under the
plain `Trainer` (one process, or DDP) and under `ZeroPPTrainer`: the only lines that differ are
its construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from torch.utils.data import IterableDataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    DataCollatorForLanguageModeling,
    DataCollatorWithFlattening,
    PreTrainedTokenizerFast,
    TrainerCallback,
    TrainingArguments,
)

VOCAB = 64
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
}
# BERT-MLM: its forward computes its own mean cross-entropy (it ignores num_items_in_batch);
# dropout off, so the pipeline and one process draw no random numbers
BERT = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "max_position_embeddings": 32,
    "pad_token_id": 0,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}
MASK_ID = 1  # the masked-LM collator's [MASK]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Script:
    family: str = "llama"
    tie_word_embeddings: bool | None = False  # None: the family's own default
    config: dict[str, Any] = field(default_factory=dict)  # more of the family's config
    lora: bool = False
    rows: str = "equal"  # "equal" (12 tokens each), "padded" (3..12), "packed" (flattened)
    train_rows: int = 64
    eval_rows: int = 16
    per_device_train_batch_size: int = 2
    per_device_eval_batch_size: int = 2
    args: dict[str, Any] = field(default_factory=dict)  # more TrainingArguments
    init_seed: int = 0
    evaluate_first: bool = False
    predict: bool = False
    iterable: bool = False  # the training rows as a stream (IterableDataset; needs max_steps)


class Stream(IterableDataset):
    """Rows read in order, as from a streamed dataset."""

    def __init__(self, rows: list[dict[str, list[int]]]) -> None:
        self.rows = rows

    def __iter__(self) -> Any:
        return iter(self.rows)


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the model's vocabulary (token 0 pads)."""
    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>"
    )


def texts(rows: int, seed: int, equal: bool) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.full((rows,), 12) if equal else torch.randint(3, 13, (rows,), generator=g)
    return [
        {"input_ids": torch.randint(1, VOCAB, (int(n),), generator=g).tolist()} for n in lengths
    ]


def masked(samples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """A masked-LM collator with a fixed mask (token t at position p is masked when t + p is a
    multiple of 3), so every run masks the same tokens: right padding, padding and unmasked
    positions labelled -100, masked ones replaced by `MASK_ID`."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    attend = torch.zeros_like(ids)
    for row, s in enumerate(samples):
        ids[row, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
        attend[row, : len(s["input_ids"])] = 1
    chosen = ((ids + torch.arange(longest)) % 3 == 0) & (attend == 1)
    labels = ids.masked_fill(~chosen, -100)
    return {
        "input_ids": ids.masked_fill(chosen, MASK_ID),
        "attention_mask": attend,
        "labels": labels,
    }


def model_class(family: str) -> type:
    return AutoModelForMaskedLM if family == "bert" else AutoModelForCausalLM


def build_model(script: Script) -> torch.nn.Module:
    if script.family == "bert":
        torch.manual_seed(script.init_seed)
        return AutoModelForMaskedLM.from_config(
            AutoConfig.for_model("bert", **BERT, **script.config)
        )
    tie = (
        {}
        if script.tie_word_embeddings is None
        else {"tie_word_embeddings": script.tie_word_embeddings}
    )
    config = AutoConfig.for_model(script.family, **TINY, **tie, **script.config)
    torch.manual_seed(script.init_seed)
    model = AutoModelForCausalLM.from_config(config)
    if script.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
        model = get_peft_model(model, lora)  # B nonzero: adapters change the outputs at once
    return model


def token_accuracy(prediction: Any) -> dict[str, float]:
    """`compute_metrics`: next-token accuracy over the labelled positions."""
    logits, labels = prediction.predictions, prediction.label_ids
    guess = np.argmax(logits[:, :-1], axis=-1)
    target = labels[:, 1:]
    keep = target != -100
    return {"accuracy": float((guess[keep] == target[keep]).mean())}


class Recorder(TrainerCallback):
    """A user's callback: keeps every log and counts optimizer steps."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []
        self.steps = 0

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        self.logs.append(dict(logs or {}))

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.steps += 1


def run(
    trainer_cls: type, script: Script, output_dir: str, resume: str | None = None, **extra: Any
) -> dict[str, Any]:
    """The script. Returns the logs, evaluation and prediction results, and the trainer."""
    tok = tokenizer()
    model = build_model(script)
    train: Any = texts(script.train_rows, 1, script.rows == "equal")
    if script.iterable:
        train = Stream(train)
    evals = texts(script.eval_rows, 2, script.rows == "equal")
    if script.family == "bert":
        collator: Any = masked
    elif script.rows == "packed":
        collator = DataCollatorWithFlattening()
    else:
        collator = DataCollatorForLanguageModeling(tok, mlm=False)
    settings = {
        "output_dir": output_dir,
        "per_device_train_batch_size": script.per_device_train_batch_size,
        "per_device_eval_batch_size": script.per_device_eval_batch_size,
        "learning_rate": 3e-3,
        "max_steps": 4,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "save_strategy": "no",
    }
    args = TrainingArguments(**{**settings, **script.args})
    recorder = Recorder()
    bert = script.family == "bert"
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evals,
        data_collator=collator,
        processing_class=tok,
        compute_metrics=token_accuracy if script.rows != "packed" and not bert else None,
        callbacks=[recorder],
        **extra,
    )
    out: dict[str, Any] = {"trainer": trainer}
    if script.evaluate_first:
        out["first_eval"] = trainer.evaluate()
    trainer.train(resume_from_checkpoint=resume)
    out["logs"] = recorder.logs
    out["steps"] = recorder.steps
    if script.predict:
        out["predict"] = trainer.predict(evals)
    return out
