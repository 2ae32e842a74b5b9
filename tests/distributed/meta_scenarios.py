"""Models built on the meta device, then materialized (init) or loaded (safetensors, DCP) by
each rank for its own shards only; trained as the parity scenarios train."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_zeropp import launch_layout
from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from lightning_zeropp.core.weights.checkpoint import save_checkpoint
from lightning_zeropp.core.weights.init_modules import init_weights
from lightning_zeropp.core.weights.materialize import empty_parameters
from lightning_zeropp.models import GPT
from lightning_zeropp.models.gpt import Block
from tests.distributed.common import (
    GLOBAL_BATCH,
    MODEL,
    lm_loss,
    make_batches,
    make_model,
    make_optimizer,
)

INIT_SEED = 1234  # the seed every rank sets before building (as seed_everything would)


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=MODEL.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        use_cache=False,  # a training run's setting: the pipeline passes tensors only
    )


def llama_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits.float()
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def build(model: str, how: str) -> nn.Module:
    """`how`: "empty" (parameters on meta, buffers real) or "meta" (everything on meta)."""
    torch.manual_seed(INIT_SEED)
    context = empty_parameters() if how == "empty" else torch.device("meta")
    with context:
        if model == "gpt":
            return GPT(MODEL)
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(llama_config())


def meta_parity(cases: list[dict[str, Any]], checkpoint_dir: str) -> dict[str, Any]:
    return {case["id"]: _run(checkpoint_dir=checkpoint_dir, **case) for case in cases}


def _run(
    id: str,
    model: str,
    how: str,
    layout: dict[str, Any],
    checkpoint_dir: str,
    load_from: str | None = None,
    save_dcp: bool = False,
) -> dict[str, Any]:
    config = ZeroPPConfig(**layout).resolve(dist.get_world_size())
    net = build(model, how)
    held = sum(t.numel() for t in [*net.parameters(), *net.buffers()] if not t.is_meta)
    loss_fn = lm_loss if model == "gpt" else llama_loss
    micro = GLOBAL_BATCH // config.dp_size // config.num_microbatches
    example = (torch.zeros(micro, MODEL.seq_len, dtype=torch.long),)
    engine = ZeroPPEngine(
        net, launch_layout(config), loss_fn=loss_fn, example_args=example, load_from=load_from
    )
    initial = {n: _full(p) for n, p in engine.module.named_parameters()}
    local = sum(_local(p).numel() for p in engine.parameters())
    if save_dcp:  # the initial weights, for a case of another layout to load
        save_checkpoint(checkpoint_dir, engine.module, [])
    opt = make_optimizer("adamw", engine.parameters())
    losses = []
    for x, y in make_batches(3):
        per_rank = GLOBAL_BATCH // engine.dims.dp_size
        rows = slice(engine.dims.dp_rank * per_rank, (engine.dims.dp_rank + 1) * per_rank)
        losses.append(float(engine.train_step(x[rows], target=y[rows])))
        opt.step()
        opt.zero_grad()
    params = {n: _full(p) for n, p in engine.module.named_parameters()}
    return {
        "initial": initial,
        "params": params,
        "losses": losses,
        "held_before_build": held,
        "local_numel": local,
        "gathered_peak": engine.gathered_peak,  # first step, shape inference included
        "activation_peak": engine.activation_peak,
        "stage_bytes": [
            sum(p.numel() * p.element_size() for p in m.parameters())  # whole, not the shard
            for m in engine._stage_modules
        ],
    }


# ---------------------------------------------------------------------- for the test process
def llama(seed: int) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(llama_config())


def gpt_eager() -> nn.Module:
    """What one built under `empty_parameters()` gets: its constructor's init, as eagerly."""
    torch.manual_seed(INIT_SEED)
    return GPT(MODEL)


def llama_init() -> nn.Module:
    model = llama(5)  # other values first: init_weights must replace them all
    init_weights(model, seed=INIT_SEED)
    return model


def hf_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return llama_loss(model(x), y)


def write_sources(root: Path) -> Path:
    """The weights the load cases read: the bundled GPT's (seed 0) as one safetensors file, a
    tied Llama's (seed 0) as an HF directory (which stores the tied weight once)."""
    from safetensors.torch import save_file

    gpt = make_model()
    save_file({k: v.contiguous() for k, v in gpt.state_dict().items()}, root / "gpt.safetensors")
    llama(0).save_pretrained(root / "llama")
    return root


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


class NanoGPT(nn.Module):
    """nanoGPT's way: the init lives in the constructor (`self.apply(self._init_weights)`,
    normal(0, 0.02) weights, scaled residual projections, zeroed attention projections), and the
    head is tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(MODEL.vocab_size, MODEL.dim)
        self.pos_emb = nn.Embedding(MODEL.seq_len, MODEL.dim)
        self.blocks = nn.ModuleList(Block(MODEL) for _ in range(4))
        self.ln_f = nn.LayerNorm(MODEL.dim)
        self.head = nn.Linear(MODEL.dim, MODEL.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("mlp.2.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * len(self.blocks)))
            if name.endswith("attn.proj.weight"):
                torch.nn.init.zeros_(p)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def nano_eager() -> nn.Module:
    """One process's nanoGPT: built eagerly from the seed every rank sets (init included)."""
    torch.manual_seed(INIT_SEED)
    return NanoGPT()
