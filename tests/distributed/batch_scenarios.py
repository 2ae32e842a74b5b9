"""Random collators under a pipeline: each rank of a pipeline collates the same rows itself, with
its own random state, and the stages must still step on one batch (`core.step.pipeline_batch`).

- `accelerate_loop`: an Accelerate loop (`ZeroPPAccelerator`) over a tiny Llama whose collator
  draws (labels hidden and input tokens replaced at random, from torch's generator), with each
  process seeded apart as `set_seed(seed, device_specific=True)` seeds them; the collator runs
  in the main process or in a loader worker. It records the batch each rank trained on, the
  losses and the trained weights: the test replays the first stages' batches in one process.
- `trainer_bert`: `ZeroPPTrainer` over a tiny `BertForMaskedLM` (dropout 0.1) with HF's
  `DataCollatorForLanguageModeling(mlm=True)`, the batch check on (`ZEROPP_CHECK_BATCH=1`). It
  records the token ids the word embedding read (the first stage) and the labels the loss read
  (the last stage), in training and evaluation.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

VOCAB = 64
ROWS, LENGTH = 32, 12
LR = 0.5
# the BERT vocabulary's special tokens: rows never hold them, so a [MASK] in the inputs is the
# collator's
PAD, UNK, CLS, SEP, MASK = range(5)


# ------------------------------------------------------------------------- the Accelerate loop
class Rows(Dataset):
    """Rows of LENGTH tokens (equal lengths: one process concatenates the ranks' batches)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.rows = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=g)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i]}


def random_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A collator that draws: about a third of the labels hidden, a fifth of the inputs replaced
    by random tokens (torch's generator, of whatever process collates)."""
    ids = torch.stack([s["input_ids"] for s in samples])
    labels = ids.masked_fill(torch.rand(ids.shape) < 0.3, -100)
    noise = torch.randint(1, VOCAB, ids.shape)
    return {"input_ids": torch.where(torch.rand(ids.shape) < 0.2, noise, ids), "labels": labels}


def accelerate_loop(steps: int, workers: int) -> dict[str, Any]:
    from accelerate.utils import set_seed

    from lightning_zeropp.accelerate import ZeroPPAccelerator, ZeroPPPlugin
    from tests.distributed.accelerate_scenarios import make_llama

    plugin = ZeroPPPlugin(pp_size=2, num_microbatches=2)
    accelerator = ZeroPPAccelerator(zeropp_plugin=plugin, cpu=True)
    model = make_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(Rows(), batch_size=2, collate_fn=random_collate, num_workers=workers)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    set_seed(0, device_specific=True)  # each process its own random stream, as under DDP
    batches, losses = [], []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        batches.append({k: v.clone() for k, v in batch.items()})  # as the loop reads it after
        losses.append(float(loss.detach()))
        if len(losses) == steps:
            break
    dims = model.engine.dims
    out = {"batches": batches, "losses": losses, "pp_rank": dims.pp_rank, "dp_rank": dims.dp_rank}
    out["params"] = accelerator.get_state_dict(model)  # collective; rank 0 holds them
    accelerator.free_memory()
    return out


def llama_reference(batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """One process trains on the given global batches (the first stages' ones, joined)."""
    from tests.distributed.accelerate_scenarios import make_llama

    model = make_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {k: v.detach() for k, v in model.state_dict().items()}}


# ------------------------------------------------------------------------- the Trainer, BERT-MLM
def bert_tokenizer() -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    names = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {**{n: i for i, n in enumerate(names)}, **{f"t{i}": i for i in range(5, VOCAB)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")),
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def _bert_rows(rows: int, seed: int) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(5, VOCAB, (rows, LENGTH - 2), generator=g)
    return [{"input_ids": [CLS, *r.tolist(), SEP]} for r in body]


class _Seen:
    """What the stages read inside the Trainer's loss calls (`compute_loss`, training and
    evaluation; not the build's): the word embedding's token ids (first stage) and the MLM
    loss's labels (last stage)."""

    def __init__(self) -> None:
        self.active = False
        self.ids: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []
        self._embedding = torch.nn.Embedding.forward
        self._cross_entropy = torch.nn.CrossEntropyLoss.forward

    def __enter__(self) -> _Seen:
        seen, embedding, cross_entropy = self, self._embedding, self._cross_entropy

        def embed(module: torch.nn.Embedding, x: torch.Tensor) -> torch.Tensor:
            if seen.active and module.num_embeddings == VOCAB:
                seen.ids.append(x.detach().clone())
            return embedding(module, x)

        # BERT's loss module, not F.cross_entropy: rebinding torch.nn.functional's name would
        # hide the call from torch function modes (F.cross_entropy dispatches under its own
        # module-level name), which the library's loss rule counts with.
        def loss(
            module: torch.nn.CrossEntropyLoss, logits: torch.Tensor, target: torch.Tensor
        ) -> Any:
            if seen.active:
                seen.labels.append(target.detach().clone())
            return cross_entropy(module, logits, target)

        torch.nn.Embedding.forward = embed  # type: ignore[method-assign]
        torch.nn.CrossEntropyLoss.forward = loss  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.nn.Embedding.forward = self._embedding  # type: ignore[method-assign]
        torch.nn.CrossEntropyLoss.forward = self._cross_entropy  # type: ignore[method-assign]


def trainer_bert(out_dir: str, steps: int) -> dict[str, Any]:
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        DataCollatorForLanguageModeling,
        TrainingArguments,
    )

    from lightning_zeropp.transformers import ZeroPPPlugin, ZeroPPTrainer

    os.environ["ZEROPP_CHECK_BATCH"] = "1"  # every rank: the stages' batches compared per step
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=LENGTH,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        pad_token_id=PAD,
    )
    torch.manual_seed(0)
    model = BertForMaskedLM(config)
    tok = bert_tokenizer()
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        learning_rate=1e-2,
        max_steps=steps,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
    )
    trainer = ZeroPPTrainer(
        model=model,
        args=args,
        train_dataset=_bert_rows(ROWS, 1),
        eval_dataset=_bert_rows(8, 2),
        data_collator=DataCollatorForLanguageModeling(tok, mlm=True),
        processing_class=tok,
        zeropp_plugin=ZeroPPPlugin(pp_size=2, num_microbatches=1, schedule="gpipe"),
    )
    compute_loss = trainer.compute_loss

    def recorded(*args: Any, **kwargs: Any) -> Any:
        seen.active = True
        try:
            return compute_loss(*args, **kwargs)
        finally:
            seen.active = False

    trainer.compute_loss = recorded  # type: ignore[method-assign]
    try:
        with _Seen() as seen:
            trainer.train()
            metrics = trainer.evaluate()
    finally:
        del os.environ["ZEROPP_CHECK_BATCH"]
    dims = trainer.pipeline.engine.dims
    out = {"ids": seen.ids, "labels": seen.labels, "eval_loss": metrics["eval_loss"]}
    out |= {"pp_rank": dims.pp_rank, "dp_rank": dims.dp_rank}
    trainer.accelerator.free_memory()
    return out


def run(out_dir: str, steps: int) -> dict[str, Any]:
    return {
        "accelerate": accelerate_loop(steps, workers=0),
        "workers": accelerate_loop(2, workers=1),
        "bert": trainer_bert(out_dir, steps),
    }
