"""The 3-D baseline of bench_zeropp.py: tensor x pipeline x data parallelism from torch's pieces.

The core has no tensor parallelism, so this row is built by hand: the bundled GPT cut into `pp`
stages of whole blocks, each block's attention and MLP split over `tp` ranks with
`torch.distributed.tensor.parallel`, FSDP2 over `dp_shard`, and torch's `Schedule1F1B`. It returns
the same job dictionary as bench_zeropp.py's engine rows (parameters, data-parallel place, a step
function, a mesh-axis namer for `CommCounter`, a `StepRecorder` factory).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["tp_pp_dp_job"]


def tp_pp_dp_job(
    sizes: dict[str, int],
    model_config: dict[str, int],
    microbatches: int,
    loss_fn: Callable[..., Any],
) -> dict[str, Any]:
    """TP x PP x DP on the same GPT, from torch's own pieces (the core has no tensor parallelism).

    Attention uses separate q/k/v projections so that column-parallel heads stay whole (the fused
    qkv of the bundled GPT would mix q, k and v across TP ranks): the same parameter count and
    FLOPs, not the same numbers.
    """
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from lightning_zeropp.core.measure.axes import mesh_axis_namer
    from lightning_zeropp.core.measure.timeline import StepRecorder
    from lightning_zeropp.models import GPT, GPTConfig

    class HeadParallelAttention(nn.Module):
        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.heads, self.head_dim = heads, dim // heads
            self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
            self.proj = nn.Linear(dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = (
                f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v)
            )  # -1: the heads local to this TP rank
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, -1))

    pp, tp, dp = sizes["pp"], sizes["tp"], sizes["dp"]
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp_shard", "tp"))
    pp_rank = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    cfg = GPTConfig(**model_config)
    model = GPT(cfg)
    per_stage = cfg.num_layers // pp
    keep = range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
    model.blocks = nn.ModuleList([model.blocks[i] for i in keep])
    if pp_rank != 0:
        model.tok_emb = model.pos_emb = None  # type: ignore[assignment]
    if pp_rank != pp - 1:
        model.norm = model.head = None  # type: ignore[assignment]
    for block in model.blocks:
        block.attn = HeadParallelAttention(cfg.dim, cfg.num_heads)
        parallelize_module(
            block,
            mesh["tp"],
            {
                "attn.q": ColwiseParallel(),
                "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.0": ColwiseParallel(),
                "mlp.2": RowwiseParallel(),
            },
        )
        fully_shard(block, mesh=mesh["dp_shard"], reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp_shard"], reshard_after_forward=False)
    stage = PipelineStage(model, pp_rank, pp, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if pp_rank == 0:
            schedule.step(x, target=y, losses=losses)
        else:
            schedule.step(target=y, losses=losses)
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        torch.distributed.broadcast(loss, group=mesh["pp"].get_group(), group_src=pp - 1)
        return loss

    class _Job:  # what StepRecorder reads from an engine
        stages = [stage]
        dims = type("Dims", (), {"mesh": mesh})

    return {
        "params": list(model.parameters()),
        "dp_size": dp,
        "dp_rank": mesh["dp_shard"].get_local_rank(),
        "pp_rank": pp_rank,
        "namer": mesh_axis_namer(mesh),
        "step": step,
        "recorder": lambda: StepRecorder(_Job()),
    }
