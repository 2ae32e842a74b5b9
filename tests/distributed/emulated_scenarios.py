"""Scenario: steps on the emulated device (bench/emulated_device.py): each block's forward, input
gradient and weight gradient a timed wait, everything else real; report what the device ran."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from tests.distributed.common import MODEL, lm_loss, make_batches, make_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def steps(layouts: list[dict[str, Any]], forward_s: float) -> list[dict[str, Any]]:
    """For each layout: one warm-up step, then one recorded step (from a barrier to the
    device's last task), its device spans and busy seconds."""
    from emulated_device import BlockCost, EmulatedDevice, emulate_blocks, install

    out = []
    for layout in layouts:
        config = ZeroPPConfig(**layout).resolve(dist.get_world_size())
        model = make_model()
        device = EmulatedDevice()
        costs = [BlockCost(forward_s, forward_s, forward_s)] * MODEL.num_layers
        emulate_blocks(list(model.blocks), costs, device)
        micro = 16 // config.dp_size // config.num_microbatches
        example = (torch.zeros(micro, MODEL.seq_len, dtype=torch.long),)
        engine = ZeroPPEngine(model, config, loss_fn=lm_loss, example_args=example)
        ((x, y),) = make_batches(1)
        with install(device):
            for record in (False, True):
                device.sync()
                dist.barrier()
                device.record, busy = record, device.busy
                start = time.perf_counter()
                loss = engine.train_step(x, target=y)
                device.sync()
                end = time.perf_counter()
        out.append({
            "pp_rank": engine.dims.pp_rank, "start": start, "end": end,
            "busy": device.busy - busy, "spans": device.spans, "loss": float(loss),
        })  # fmt: skip
    return out
