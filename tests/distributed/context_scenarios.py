"""Context parallelism (cp_size > 1) on gloo ranks against the core engine: the bundled GPT, a
module reading a learned positional table by slicing, an HF Llama with right-padded rows, and
the bad inputs refused at setup."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_zeropp import launch_layout
from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from lightning_zeropp.models.gpt import Block, GPTConfig
from lightning_zeropp.models.hf import build_causal_lm
from tests.distributed.common import GLOBAL_BATCH, MODEL, lm_loss, make_optimizer
from tests.distributed.core_scenarios import _full, _rows, _train

LLAMA = {
    "vocab_size": MODEL.vocab_size,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention: only the K/V heads are gathered
    "head_dim": 8,
    "max_position_embeddings": 64,
}
ROW_LENGTHS = (16, 11, 16, 7, 14, 16, 9, 16)  # right-padded rows of the padded-rows case


class TableLM(nn.Module):
    """A decoder whose positions are a learned table read as `self.pos[: idx.shape[1]]`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=MODEL.vocab_size, seq_len=MODEL.seq_len, dim=32, num_heads=2)
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.dim) * 0.5)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(4)])
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_llama(attn: str = "sdpa") -> nn.Module:
    return build_causal_lm("llama", seed=0, attn_implementation=attn, **LLAMA)


DOCUMENTS = ((5, 7, 4), (16,), (3, 3, 10), (8, 8), (2, 14), (11, 5), (6, 6, 4), (1, 15))


def padded_batches(steps: int, rows: str = "right") -> list[dict[str, torch.Tensor]]:
    """The same batches every run: `rows="right"` or `"left"`: padded rows (pad id 0, label
    -100 on the pads, an attention_mask); `"packed"`: documents packed into each row as
    `DataCollatorWithFlattening` packs them (position_ids restarting per document, label -100
    on each document's first token, no attention_mask)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        x = torch.randint(1, MODEL.vocab_size, (GLOBAL_BATCH, MODEL.seq_len), generator=g)
        batch: dict[str, torch.Tensor] = {}
        if rows == "packed":
            docs = [DOCUMENTS[row % len(DOCUMENTS)] for row in range(GLOBAL_BATCH)]
            positions = torch.stack([torch.cat([torch.arange(n) for n in d]) for d in docs])
            labels = x.masked_fill(positions == 0, -100)
            batch["position_ids"] = positions
        else:
            mask = torch.zeros_like(x)
            for row, n in enumerate(ROW_LENGTHS[:GLOBAL_BATCH]):
                mask[row, :n] = 1
            mask = mask if rows == "right" else mask.flip(1)
            x = x * mask
            labels = x.masked_fill(mask == 0, -100)
            batch["attention_mask"] = mask
        shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
        out.append({"input_ids": x, **batch, "labels": labels, "shifted": shifted})
    return out


def _model_inputs(b: dict[str, torch.Tensor], rows: Any = slice(None)) -> dict[str, Any]:
    return {k: b[k][rows] for k in ("input_ids", "attention_mask", "position_ids") if k in b}


def llama_reference(steps: int = 3, rows: str = "right") -> dict[str, Any]:
    """One process: the mean over the global batch's labelled tokens, the HF way."""
    model = make_llama()
    opt = make_optimizer("adamw", model.parameters())
    losses = []
    for b in padded_batches(steps, rows):
        logits = model(**_model_inputs(b)).logits
        loss = F.cross_entropy(logits.flatten(0, 1), b["shifted"].flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def parity(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Every case's losses and full parameters after a few steps (`core_scenarios._train` for
    the bundled GPT; the table module and the Llama here)."""
    out = {}
    for case in cases:
        kind = case.pop("kind", "gpt")
        if kind == "gpt":
            out[case["id"]] = _train(**case)
        elif kind == "table":
            out[case["id"]] = _train_table(**case)
        elif kind == "llama":
            out[case["id"]] = _train_llama(**case)
    return out


def _train_table(id: str, layout: dict[str, Any], steps: int = 3) -> dict[str, Any]:
    from tests.distributed.common import make_batches

    config = ZeroPPConfig(**layout).resolve(dist.get_world_size())
    micro = GLOBAL_BATCH // config.dp_size // config.num_microbatches
    example = (torch.zeros(micro, MODEL.seq_len, dtype=torch.long),)
    engine = ZeroPPEngine(TableLM(), launch_layout(config), loss_fn=lm_loss, example_args=example)
    opt = make_optimizer("adamw", engine.parameters())
    losses = []
    for x, y in make_batches(steps):
        rows = _rows(engine, GLOBAL_BATCH)
        losses.append(float(engine.train_step(x[rows], target=y[rows])))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": {n: _full(p) for n, p in engine.module.named_parameters()}}


def _train_llama(
    id: str, layout: dict[str, Any], labels: bool, steps: int = 3, rows: str = "right"
) -> dict[str, Any]:
    """`labels=False`: the loss is the engine's loss_fn over targets shifted by the test;
    `labels=True`: HF's own loss from a `labels` keyword (the engine shifts it on the whole
    sequence) with `num_items_in_batch`. Either divides the token sum by the global count per
    micro-batch, data-parallel and CP rank, so the engine's mean is the global token mean."""
    config = ZeroPPConfig(**layout).resolve(dist.get_world_size())
    parts = config.num_microbatches * config.dp_size * config.cp_size

    def own_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out if isinstance(out, torch.Tensor) else out["logits"]
        summed = F.cross_entropy(
            logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100, reduction="sum"
        )
        return summed / count

    def hf_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
        return out.loss if hasattr(out, "loss") else out["loss"]

    micro = GLOBAL_BATCH // config.dp_size // config.num_microbatches

    def inputs(b: dict[str, torch.Tensor], part: slice, count: float) -> dict[str, Any]:
        kwargs = _model_inputs(b, part)
        if labels:
            kwargs |= {"labels": b["labels"][part], "num_items_in_batch": count}
        return kwargs

    example = inputs(padded_batches(1, rows)[0], slice(0, micro), 1.0)
    loss_fn = hf_loss if labels else own_loss
    engine = ZeroPPEngine(
        make_llama(), launch_layout(config), loss_fn=loss_fn, example_kwargs=example
    )
    opt = make_optimizer("adamw", engine.parameters())
    losses = []
    for b in padded_batches(steps, rows):
        count = float((b["shifted"] != -100).sum()) / parts
        part = _rows(engine, GLOBAL_BATCH)
        kwargs = inputs(b, part, count)
        target = b["shifted"][part]
        losses.append(float(engine.train_step(target=target, **kwargs)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": {n: _full(p) for n, p in engine.module.named_parameters()}}


# ---------------------------------------------------------------------- bad inputs
def _gpt_engine(seq: int | None, **layout: Any) -> ZeroPPEngine:
    from tests.distributed.common import make_model

    example = (torch.zeros(2, seq, dtype=torch.long),) if seq else None
    split = "call" if seq else "stack"  # the stack split needs no example: checked at the step
    config = ZeroPPConfig(**layout)
    return ZeroPPEngine(
        make_model(), launch_layout(config), loss_fn=lm_loss, example_args=example, split=split
    )


def _attempt_length_at_setup() -> None:
    _gpt_engine(12, cp_size=4)  # 12 tokens do not split into 8 chunks


def _attempt_length_at_step() -> None:
    engine = _gpt_engine(None, cp_size=2, dp_shard_size=2)
    x = torch.zeros(4, 10, dtype=torch.long)
    engine.train_step(x, target=x)


def _attempt_cp_not_dividing() -> None:
    _gpt_engine(16, cp_size=3)


def _attempt_eager_attention() -> None:
    ZeroPPEngine(make_llama("eager"), launch_layout(ZeroPPConfig(cp_size=2)), loss_fn=lm_loss)


def _attempt_left_padding_traced() -> None:
    # a traced pipeline's graph takes the example's 2-D mask: left-padded rows, which need the
    # 4-D mask over all keys, are refused at the step
    x = torch.ones(2, 16, dtype=torch.long)
    right = {"input_ids": x, "attention_mask": torch.ones_like(x)}
    config = ZeroPPConfig(pp_size=2, cp_size=2, num_microbatches=2)
    engine = ZeroPPEngine(
        make_llama(), launch_layout(config), loss_fn=lm_loss, example_kwargs=right
    )
    left = torch.ones_like(x)
    left[0, :3] = 0
    engine.train_step(input_ids=x, attention_mask=left, target=x)


class _NoAttention(nn.Module):
    """Mixes tokens without scaled_dot_product_attention (a hand-written or no attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(MODEL.vocab_size, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, MODEL.vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x).cumsum(1)  # each token sees the earlier ones: attention-like
        return self.head(x)


def _attempt_no_attention() -> None:
    x = torch.zeros(2, 16, dtype=torch.long)
    engine = ZeroPPEngine(
        _NoAttention(),
        launch_layout(ZeroPPConfig(pp_size=1, cp_size=2)),
        loss_fn=lm_loss,
        example_args=(x,),
    )
    engine.train_step(x, target=x)


ATTEMPTS = {
    "cp_no_attention": _attempt_no_attention,
    "cp_length_at_setup": _attempt_length_at_setup,
    "cp_length_at_step": _attempt_length_at_step,
    "cp_not_dividing_the_world": _attempt_cp_not_dividing,
    "cp_eager_attention": _attempt_eager_attention,
    "cp_left_padding_traced": _attempt_left_padding_traced,
}


def bad_inputs(names: list[str]) -> dict[str, str]:
    """Each attempt's error message on this rank ("no error" when it passed)."""
    out = {}
    for name in names:
        try:
            ATTEMPTS[name]()
            out[name] = "no error"
        except Exception as err:  # noqa: BLE001 - the message is what the test reads
            out[name] = f"{type(err).__name__}: {err}"
    return out


def run(cases: list[dict[str, Any]], attempts: list[str]) -> dict[str, Any]:
    """The parity cases, then the bad inputs, in one launch."""
    return {"parity": parity(cases), "bad": bad_inputs(attempts)}
