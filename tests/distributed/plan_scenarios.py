"""What a run allocates per rank, for the planner's predictions to be checked against."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_zeropp import launch_layout
from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from lightning_zeropp.core._torch_private import unsharded_gradient_bytes
from lightning_zeropp.core.measure.axes import mesh_axis_namer
from lightning_zeropp.core.measure.comm import CommCounter
from lightning_zeropp.core.measure.memory import SavedActivations, model_state_bytes
from lightning_zeropp.models import GPT, GPTConfig
from lightning_zeropp.models.hf import build_causal_lm
from tests.distributed.common import lm_loss

# An odd vocabulary and row counts that 4 ranks do not divide: uneven and empty shards.
MODEL = GPTConfig(vocab_size=63, seq_len=16, dim=36, num_heads=2, num_layers=8)
# A tiny Llama (grouped-query attention, SwiGLU, RMSNorm, rotary), untied as pipelines need.
LLAMA = {
    "vocab_size": 63, "hidden_size": 32, "intermediate_size": 72, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
}  # fmt: skip


def hf_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    return lm_loss(output.logits, target)


GLOBAL_BATCH = 16


def measure(layouts: list[dict[str, Any]], optimizer: str = "adamw") -> list[dict[str, Any]]:
    """Per layout: this rank's model-state bytes after one update, and the gathered peak."""
    out = []
    for settings in layouts:
        layout = {k: v for k, v in settings.items() if k != "model"}
        config = ZeroPPConfig(**layout).resolve(dist.get_world_size())
        torch.manual_seed(0)
        if settings.get("model") == "llama":  # a plain HF model, cut at its decoder layers' calls
            rows = GLOBAL_BATCH // config.dp_size // config.num_microbatches
            example = (torch.zeros(rows, MODEL.seq_len, dtype=torch.long),)
            engine = ZeroPPEngine(
                build_causal_lm("llama", **LLAMA), launch_layout(config), loss_fn=hf_loss, split="call",
                example_args=example,
            )  # fmt: skip
        else:
            engine = ZeroPPEngine(GPT(MODEL), launch_layout(config), loss_fn=lm_loss, split="stack")
        params = list(engine.parameters())
        opt = (
            torch.optim.AdamW(params, lr=1e-3)
            if optimizer == "adamw"
            else torch.optim.SGD(params, lr=0.1)
        )
        per = GLOBAL_BATCH // config.dp_size
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, MODEL.vocab_size, (per, MODEL.seq_len), generator=g)
        engine.train_step(x, target=x)
        opt.step()
        opt.zero_grad()
        # The first step's peaks include torch's shape inference; the second is the steady state.
        grads = _GradientPeak(engine)
        with (
            SavedActivations() as saved,
            CommCounter(mesh_axis_namer(engine.dims.mesh)) as comm,
            grads,
        ):
            engine.train_step(x, target=x)
        out.append(
            {
                **model_state_bytes(params, opt),
                "gathered_peak": engine.gathered_peak,
                "activation_peak": saved.peak,
                "gradient_peak": grads.peak,
                "comm": comm.summary(),
            }
        )
    return out


class _GradientPeak:
    """The most unsharded gradient bytes a rank holds after any of its compute tasks: what FSDP
    accumulates over a step's micro-batches until the reduce-scatter."""

    NAMES = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, engine: ZeroPPEngine) -> None:
        self.engine = engine
        self.peak = 0

    def __enter__(self) -> _GradientPeak:
        for stage in self.engine.stages:
            for name in self.NAMES:
                stage.__dict__[name] = self._wrap(getattr(stage, name))
        return self

    def __exit__(self, *exc: object) -> None:
        for stage in self.engine.stages:
            for name in self.NAMES:
                stage.__dict__.pop(name, None)

    def _wrap(self, method: Any) -> Any:
        def sampled(*args: Any, **kwargs: Any) -> Any:
            out = method(*args, **kwargs)
            held = sum(unsharded_gradient_bytes(s.submod) for s in self.engine.stages)
            self.peak = max(self.peak, held)
            return out

        return sampled
