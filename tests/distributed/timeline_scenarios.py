"""Scenario: record a real ZeroPP step with `StepRecorder` and report what it saw."""

from __future__ import annotations

from typing import Any

import torch

from lightning_zeropp import launch_layout
from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from lightning_zeropp.core.measure.axes import mesh_axis_namer
from lightning_zeropp.core.measure.comm import CommCounter
from lightning_zeropp.core.measure.timeline import StepRecorder
from tests.distributed.common import MODEL, lm_loss, make_batches, make_model


def record(layout: dict[str, Any], global_batch: int = 16) -> dict[str, Any]:
    config = ZeroPPConfig(**layout).resolve(torch.distributed.get_world_size())
    micro = global_batch // config.dp_size // config.num_microbatches
    example = (torch.zeros(micro, MODEL.seq_len, dtype=torch.long),)
    engine = ZeroPPEngine(
        make_model(), launch_layout(config), loss_fn=lm_loss, example_args=example
    )
    per = global_batch // config.dp_size
    rows = slice(engine.dims.dp_rank * per, (engine.dims.dp_rank + 1) * per)
    (x, y), (x2, y2) = make_batches(2, global_batch=global_batch)
    engine.train_step(x[rows], target=y[rows])  # shape inference runs here
    with CommCounter(mesh_axis_namer(engine.dims.mesh)) as counter, StepRecorder(engine) as rec:
        engine.train_step(x2[rows], target=y2[rows])
    chunk_bytes = {
        s.stage_index: sum(p.numel() * p.element_size() for p in s.submod.parameters())
        for s in engine.stages
    }  # sharded DTensors report their full (unsharded) shape
    return {
        "timeline": rec.timeline.to_dict(),
        "pp_rank": engine.dims.pp_rank,
        "all_gathers": counter.summary()["all_gather"]["dp_shard"]["count"],
        "chunk_bytes": chunk_bytes,
    }
