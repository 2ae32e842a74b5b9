"""A causal-LM training loop in the shape of transformers' `run_clm_no_trainer.py`, written here.

It is what an HF user already has: a model from a config, decay / no-decay parameter groups,
`get_scheduler` sized with Accelerate's `num_processes` arithmetic, right-padded batches with an
attention mask, `accelerate`'s accumulate / backward / clip / gather_for_metrics idioms and
`save_state`. The accelerator is passed in, so the same loop runs under plain `Accelerator` (one
process, or DDP) and under `ZeroPPAccelerator`: the only lines that differ are its construction.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM, get_scheduler

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
# What each family needs on top (its own names, dropout off: one process and the pipeline draw
# other random numbers), and which tie their embeddings in their own configs.
NO_DROPOUT = {"attention_dropout": 0.0}
EXTRA: dict[str, dict[str, Any]] = {
    "gemma": {"head_dim": 8},
    "gemma2": {"head_dim": 8, "sliding_window": 4},  # masks that differ by layer
    "phi3": {"resid_pdrop": 0.0, "embd_pdrop": 0.0},
    "gpt_neox": {"hidden_dropout": 0.0},
    "gpt2": {
        "n_positions": 32,
        "n_inner": 64,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
    # Mixture-of-experts families: 4 experts, 2 per token (router logits off unless "+router").
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
    },
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "opt": {
        "ffn_dim": 64,
        "word_embed_proj_dim": 32,
        "max_position_embeddings": 32,
        "dropout": 0.0,
        "layerdrop": 0.0,
    },
}
FAMILIES = ("llama", "gpt2", "opt", "gemma", "gemma2", "phi3", "qwen2", "mistral", "gpt_neox")
TIED_BY_DEFAULT = ("gpt2", "opt", "gemma", "gemma2")


@dataclass
class Args:
    family: str = "llama"
    tie_word_embeddings: bool = False
    per_device_train_batch_size: int = 2
    per_device_eval_batch_size: int = 2
    gradient_accumulation_steps: int = 1
    learning_rate: float = 3e-3
    weight_decay: float = 0.1
    num_warmup_steps: int = 1
    num_train_epochs: int = 1
    max_grad_norm: float | None = 0.5
    train_rows: int = 32
    eval_rows: int = 8
    seed: int = 0  # data order
    init_seed: int = 0  # the model's initial weights
    empty_init: bool = False  # build under init_empty_weights() (the plugin's load_from fills it)
    lora: bool = False  # PEFT LoRA adapters on the attention and MLP projections
    export_to: str | None = None  # run_clm's closing save_pretrained
    save_model_to: str | None = None  # accelerator.save_model, after the export
    stop_after: int | None = None  # updates, then save_state(save_to) and stop
    resume_from: str | None = None  # load_state, then skip the batches already trained on
    resumed_updates: int = 0  # how many updates the saved run made (run_clm reads the dir name)
    pad_to_multiple_of: int = 1  # the collator's (context parallelism splits 2 x cp_size chunks)


class Texts(Dataset):
    """Token rows of varied length (3..12 tokens), as a tokenized corpus without grouping."""

    def __init__(self, rows: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, 13, (rows,), generator=g)
        self.rows = [torch.randint(1, VOCAB, (int(n),), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i]}


def collate(samples: list[dict[str, torch.Tensor]], multiple: int = 1) -> dict[str, torch.Tensor]:
    """Right padding to the longest row (rounded up to `multiple`), padding masked out of the
    loss (-100), as HF's `DataCollatorForLanguageModeling(mlm=False, pad_to_multiple_of=...)`."""
    longest = -(-max(len(s["input_ids"]) for s in samples) // multiple) * multiple
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n], mask[row, :n] = s["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class OwnLossLlama(LlamaForCausalLM):
    """A model computing its own mean loss in its forward (not through `loss_function`), as a
    mean `F.cross_entropy`: the pipeline sees its count and weighs it exactly
    (`fronts.loss_rule`)."""

    def forward(self, input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        kwargs.pop("num_items_in_batch", None)
        out = super().forward(input_ids=input_ids, **kwargs)
        if labels is not None:
            logits, targets = out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
            out.loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100)
        return out


class ManualLossLlama(LlamaForCausalLM):
    """A mean loss computed by hand (per-token losses, averaged over the labelled ones): no count
    can be seen, so the pipeline cannot weigh its micro-batches by tokens, and must say so."""

    def forward(self, input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        kwargs.pop("num_items_in_batch", None)
        out = super().forward(input_ids=input_ids, **kwargs)
        if labels is not None:
            logits, targets = out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
            keep = targets != -100
            picked = logits.log_softmax(-1).gather(1, targets.clamp(min=0)[:, None])[:, 0]
            out.loss = -(picked * keep).sum() / keep.sum()
        return out


OWN_LOSS = {"llama_own_loss": OwnLossLlama, "llama_manual_loss": ManualLossLlama}


def build_model(args: Args) -> torch.nn.Module:
    if args.family == "bert":  # a masked LM (its own mean loss) on these rows' labels
        from transformers import AutoModelForMaskedLM

        from tests.distributed.trainer_script import BERT

        torch.manual_seed(args.init_seed)
        return AutoModelForMaskedLM.from_config(AutoConfig.for_model("bert", **BERT))
    if args.family in OWN_LOSS:
        torch.manual_seed(args.init_seed)
        return OWN_LOSS[args.family](AutoConfig.for_model("llama", **TINY))
    family, router = args.family.removesuffix("+router"), args.family.endswith("+router")
    config = AutoConfig.for_model(
        family,
        **{**TINY, **NO_DROPOUT, **EXTRA.get(family, {})},
        tie_word_embeddings=args.tie_word_embeddings,
    )
    if router:  # the MoE load-balancing loss, from every layer's router logits
        config.output_router_logits = True
    torch.manual_seed(args.init_seed)
    if args.empty_init:  # how HF users build a model too large for one process
        from accelerate import init_empty_weights

        with init_empty_weights():
            return AutoModelForCausalLM.from_config(config)
    model = AutoModelForCausalLM.from_config(config)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        # init_lora_weights=False: B is not zero, so the adapters change the loss at once
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        model = get_peft_model(model, lora)
    return model


def train(
    accelerator: Any,
    args: Args,
    save_to: str | None = None,
    on_update: Callable[[Any], Any] | None = None,
) -> dict[str, Any]:
    """The loop. Returns per-update losses, learning rates, clip norms, eval results, weights;
    `on_update(model)` after each update is recorded under "updates" (a test's probe)."""
    model = build_model(args)
    no_decay = ["bias", "norm.weight", "layernorm.weight"]
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)
    g = torch.Generator().manual_seed(args.seed)
    padded = functools.partial(collate, multiple=args.pad_to_multiple_of)
    train_dataloader = DataLoader(
        Texts(args.train_rows, 1),
        shuffle=True,
        collate_fn=padded,
        batch_size=args.per_device_train_batch_size,
        generator=g,
    )
    eval_dataloader = DataLoader(
        Texts(args.eval_rows, 2), collate_fn=padded, batch_size=args.per_device_eval_batch_size
    )
    # run_clm sizes the scheduler from the unprepared loader, in per-process steps.
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_scheduler(
        name="cosine",
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=max_train_steps,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    out: dict[str, Any] = {"loss": [], "lr": [], "norm": [], "batches": len(train_dataloader)}
    completed = 0
    active = train_dataloader
    if args.resume_from is not None:
        accelerator.load_state(args.resume_from)
        completed = args.resumed_updates
        active = accelerator.skip_first_batches(
            train_dataloader, completed * args.gradient_accumulation_steps
        )
    for _epoch in range(args.num_train_epochs):
        model.train()
        running = 0.0
        for batch in active:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                running += loss.detach().float().item() / args.gradient_accumulation_steps
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm is not None:
                    norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    out["norm"].append(float(norm))
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                out["loss"].append(running)
                out["lr"].append(lr_scheduler.get_last_lr()[0])
                if on_update is not None:
                    out.setdefault("updates", []).append(on_update(model))
                running = 0.0
                completed += 1
                if completed == args.stop_after:
                    accelerator.save_state(save_to)
                    return out
    model.eval()
    losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        loss = outputs.loss  # run_clm's own lines: one value per sample of this process
        losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
        out.setdefault("eval_ids", []).append(
            accelerator.gather_for_metrics(batch["input_ids"][:, 0])
        )
    out["eval_loss"] = torch.cat(losses).mean().item()
    out["perplexity"] = math.exp(out["eval_loss"])
    out["eval_ids"] = torch.cat(out["eval_ids"]).tolist()
    if save_to is not None:
        accelerator.save_state(save_to)
    state = accelerator.get_state_dict(model)
    out["params"] = {k: v.detach().clone() for k, v in state.items()}
    # (not a user's line) which parameters hold optimizer state, and which train
    names = {p: n for n, p in model.named_parameters()}
    out["with_state"] = sorted(names[p] for p, s in optimizer.optimizer.state.items() if s)
    out["frozen"] = sorted(n for p, n in names.items() if not p.requires_grad)
    if args.export_to is not None:
        accelerator.wait_for_everyone()
        unwrapped_model = accelerator.unwrap_model(model)
        head, embedding = unwrapped_model.lm_head, unwrapped_model.get_input_embeddings()
        out["unwrapped_tied"] = head.weight is embedding.weight  # one parameter, as built
        unwrapped_model.save_pretrained(
            args.export_to,
            is_main_process=accelerator.is_main_process,
            save_function=accelerator.save,
        )
        accelerator.wait_for_everyone()
    if args.save_model_to is not None:
        accelerator.save_model(model, args.save_model_to)
        accelerator.wait_for_everyone()
    return out
