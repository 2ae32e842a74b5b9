"""The workload of bench_accelerate.py: a run_clm-shaped loop, its model, data and settings.

A tiny HF Llama from a config (the same initial weights on every rank), token rows of 3/4 SEQ to
SEQ tokens right-padded to SEQ with an attention mask and `-100` labels on the padding, AdamW over
run_clm's decay / no-decay groups, and run_clm's loop (`loop_accelerate`, for plain Accelerate and
`ZeroPPAccelerator`) or its `prepare_pipeline` form (`loop_pipeline`), each step timed line by
line by a `harness.StepClock` (the laps are PHASES).
"""

from __future__ import annotations

from typing import Any

from harness import StepClock

__all__ = [
    "CLIP",
    "INNER",
    "LLAMA",
    "LR",
    "PHASES",
    "PP",
    "SEQ",
    "WEIGHT_DECAY",
    "PaddedTexts",
    "build_model",
    "collate",
    "loop_accelerate",
    "loop_pipeline",
    "param_count",
    "param_groups",
    "stage_work",
]

PP = 2
SEQ = 64
LLAMA = {  # AutoConfig.for_model("llama", **LLAMA)
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": SEQ,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    # No KV cache in training: ZeroPPAccelerator turns it off itself, prepare_pipeline refuses a
    # last stage that returns a DynamicCache; off in every row so that all compute the same.
    "use_cache": False,
}
LR, WEIGHT_DECAY, CLIP = 1e-3, 0.1, 1.0
# Per loop line, in order: what each step's time splits into. "forward" is `model(**batch)` (the
# whole pipeline step under ZeroPP) or `engine.step(batch)`; "backward" `accelerator.backward`
# (under ZeroPP: the hand-off of the step's gradients to .grad); nothing for prepare_pipeline.
PHASES = ("data", "forward", "backward", "clip", "optimizer", "scheduler", "zero_grad")
INNER = ("train_step", "token_count")  # timed by wrappers, inside "forward"


def build_model() -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **LLAMA)
    torch.manual_seed(0)  # the same initial weights in every row
    return AutoModelForCausalLM.from_config(config)


def param_groups(model: Any) -> list[dict[str, Any]]:
    """run_clm's two AdamW groups: weight decay except on biases and norms."""
    no_decay = ("bias", "norm.weight", "layernorm.weight")
    named = list(model.named_parameters())
    return [
        {
            "params": [p for n, p in named if not any(k in n for k in no_decay)],
            "weight_decay": WEIGHT_DECAY,
        },
        {"params": [p for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]


class PaddedTexts:
    """Token rows of 3/4 SEQ to SEQ tokens, padded to SEQ on the right (`padding="max_length"`:
    every batch has one shape), as a tokenized corpus."""

    def __init__(self, rows: int, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(SEQ * 3 // 4, SEQ + 1, (rows,), generator=g)
        vocab = LLAMA["vocab_size"]
        self.rows = [torch.randint(1, vocab, (int(n),), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.rows[i]}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """input_ids, attention_mask, and labels with -100 on the padding (HF's collators)."""
    import torch

    ids = torch.zeros(len(samples), SEQ, dtype=torch.long)
    mask = torch.zeros(len(samples), SEQ, dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n], mask[row, :n] = s["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loop_accelerate(
    accelerator: Any, model: Any, optimizer: Any, loader: Any, scheduler: Any, clock: StepClock
) -> None:
    """run_clm's loop, line by line (the same for DDP and ZeroPPAccelerator)."""
    model.train()
    batches = iter(loader)
    while True:
        clock.start()
        batch = next(batches, None)
        if batch is None:
            return
        clock.lap("data")
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            clock.lap("forward")
            accelerator.backward(loss)
            clock.lap("backward")
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
            clock.lap("clip")
            optimizer.step()
            clock.lap("optimizer")
            scheduler.step()
            clock.lap("scheduler")
            optimizer.zero_grad()
            clock.lap("zero_grad")
        clock.stop(float(loss.detach()))


def loop_pipeline(
    accelerator: Any, engine: Any, optimizer: Any, loader: Any, scheduler: Any, clock: StepClock
) -> None:
    """The prepare_pipeline loop: engine.step runs forward and backward together."""
    batches = iter(loader)
    while True:
        clock.start()
        batch = next(batches, None)
        if batch is None:
            return
        clock.lap("data")
        with accelerator.accumulate():
            loss = engine.step(batch)
            clock.lap("forward")
            clock.lap("backward")  # nothing: the backward ran inside engine.step
            if accelerator.sync_gradients:
                engine.clip_grad_norm_(CLIP)
            clock.lap("clip")
            optimizer.step()
            clock.lap("optimizer")
            scheduler.step()
            clock.lap("scheduler")
            optimizer.zero_grad()
            clock.lap("zero_grad")
        clock.stop(float(loss))


def stage_work(last_stage: bool) -> float:
    """A pipeline rank's matmul work (weights x rows) over a DDP rank's: half the decoder layers
    and twice the rows, the LM head on the last stage (the embedding is a lookup)."""
    h, ffn, vocab = LLAMA["hidden_size"], LLAMA["intermediate_size"], LLAMA["vocab_size"]
    kv = h * LLAMA["num_key_value_heads"] // LLAMA["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * ffn
    layers = LLAMA["num_hidden_layers"]
    ddp = layers * layer + h * vocab
    stage = layers // PP * layer + (h * vocab if last_stage else 0)
    return PP * stage / ddp


def param_count() -> int:
    return sum(p.numel() for p in build_model().parameters())
