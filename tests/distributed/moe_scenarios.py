"""A mixture of experts held as separate modules (one `nn.Linear` per expert, top-1 routing), as
many MoE codes and older HF versions write it, trained by the core engine at pp 2 x dp 2 against
one process: an expert that no row of one data-parallel rank's batch is routed to has no gradient
there while it has one on its peer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_zeropp import launch_layout
from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from tests.distributed.common import lm_loss, make_optimizer, reference

VOCAB, DIM, SEQ, EXPERTS = 32, 16, 4, 8
GLOBAL_BATCH, STEPS = 8, 3


class Routed(nn.Module):
    """Top-1 routing: each token goes through the one expert its gate picks, scaled by the
    gate's probability (so the gate trains); experts no token picks are not called at all."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.gate(x).softmax(-1)
        weight, pick = p.max(-1)
        out = torch.zeros_like(x)
        for e in pick.unique().tolist():
            rows = pick == e
            out[rows] = self.experts[e](x[rows]) * weight[rows][:, None]
        return x + out


class MoELM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Routed() for _ in range(4))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_model() -> MoELM:
    torch.manual_seed(0)
    return MoELM()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (GLOBAL_BATCH, SEQ)
    return [
        (torch.randint(0, VOCAB, shape, generator=g), torch.randint(0, VOCAB, shape, generator=g))
        for _ in range(STEPS)
    ]


def run(optimizers: list[str], aux: bool = False) -> dict[str, Any]:
    """Per optimizer: the engine at pp 2 x dp 2 (4 ranks, split='call'), and one process; with
    `aux`, also blocks returning `(x, aux)` (see `_train_aux`)."""
    out: dict[str, Any] = {name: _train(name) for name in optimizers}
    if aux:
        out["aux"] = _train_aux()
    return out


# ------------------------------------------------------------------------------ (x, aux) blocks
class SoftMoE(nn.Module):
    """Every token through every expert, weighted by its gate; returns `(x, aux)` with aux a
    batch-level load-balancing term (the squared mean routing probability per expert)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, 4)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.gate(x).softmax(-1)
        y = sum(p[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))
        return x + torch.tanh(y), (p.mean((0, 1)) ** 2).sum() * 4


class AuxLM(nn.Module):
    """The forward as users write it: each block's aux summed after it, returned with logits."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(SoftMoE() for _ in range(4))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, total = self.emb(x), 0.0
        for block in self.blocks:
            h, aux = block(h)
            total = total + aux
        return self.head(h), total


AUX_COEF = 0.1


def make_aux_model() -> AuxLM:
    torch.manual_seed(0)
    return AuxLM()


def aux_loss(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return lm_loss(out[0], y) + AUX_COEF * out[1]


def _train_aux() -> dict[str, Any]:
    """`AuxLM` at pp 2 x dp 2 with 2 micro-batches, and one process accumulating the same 4
    micro-batches of 2 rows (the aux term is each micro-batch's own, as accumulation gives)."""
    config = ZeroPPConfig(pp_size=2, num_microbatches=2).resolve(4)
    micro = GLOBAL_BATCH // config.dp_size // config.num_microbatches
    example = (torch.zeros(micro, SEQ, dtype=torch.long),)
    model = make_aux_model()
    engine = ZeroPPEngine(
        model, launch_layout(config), loss_fn=aux_loss, split="call", example_args=example
    )
    opt = make_optimizer("adamw", engine.parameters())
    per_rank = GLOBAL_BATCH // engine.dims.dp_size
    rows = slice(engine.dims.dp_rank * per_rank, (engine.dims.dp_rank + 1) * per_rank)
    losses = []
    for x, y in batches():
        losses.append(float(engine.train_step(x[rows], target=y[rows])))
        opt.step()
        opt.zero_grad()
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in engine.module.named_parameters()
    }
    steps = GLOBAL_BATCH // micro
    split = [(x[i : i + micro], y[i : i + micro]) for x, y in batches() for i in range(0, 8, micro)]
    one = reference(
        "adamw",
        False,
        STEPS,
        batches=split,
        accumulate=steps,
        model_fn=make_aux_model,
        loss_fn=lambda m, x, y: aux_loss(m(x), y),
    )
    return {"losses": losses, "params": params, "one": one, "micro_per_step": steps}


def _train(optimizer: str) -> dict[str, Any]:
    config = ZeroPPConfig(pp_size=2, num_microbatches=2).resolve(4)
    micro = GLOBAL_BATCH // config.dp_size // config.num_microbatches
    example = (torch.zeros(micro, SEQ, dtype=torch.long),)
    engine = ZeroPPEngine(
        make_model(), launch_layout(config), loss_fn=lm_loss, split="call", example_args=example
    )
    opt = make_optimizer(optimizer, engine.parameters())
    per_rank = GLOBAL_BATCH // engine.dims.dp_size
    rows = slice(engine.dims.dp_rank * per_rank, (engine.dims.dp_rank + 1) * per_rank)
    losses = []
    for x, y in batches():
        losses.append(float(engine.train_step(x[rows], target=y[rows])))
        opt.step()
        opt.zero_grad()
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in engine.module.named_parameters()
    }
    one = reference(optimizer, False, STEPS, batches=batches(), model_fn=make_model)
    return {"losses": losses, "params": params, "one": one, "unused": _unused_somewhere()}


def _unused_somewhere() -> list[tuple[int, int, list[int]]]:
    """(step, block, experts) picked by one data-parallel half of the batch and not the other, in
    one process's training: the case this scenario is for must occur."""
    model = make_model()
    opt = make_optimizer("sgd", model.parameters())
    picks: list[list[set[int]]] = []
    halves = (slice(0, GLOBAL_BATCH // 2), slice(GLOBAL_BATCH // 2, GLOBAL_BATCH))

    def record(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        picks.append([set(out[rows].argmax(-1).flatten().tolist()) for rows in halves])

    hooks = [b.gate.register_forward_hook(record) for b in model.blocks]
    found = []
    for step, (x, y) in enumerate(batches()):
        picks.clear()
        loss = lm_loss(model(x), y)
        found += [(step, block, sorted(a ^ b)) for block, (a, b) in enumerate(picks) if a ^ b]
        loss.backward()
        opt.step()
        opt.zero_grad()
    for hook in hooks:
        hook.remove()
    return found
