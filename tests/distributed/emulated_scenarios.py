"""Scenario: steps on the emulated device (bench/emulated_device.py): each block's forward, input
gradient and weight gradient a timed wait, everything else real; report what the device ran."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_zeropp import launch_layout
from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from tests.distributed.common import MODEL, lm_loss, make_batches, make_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


RECORDED = 3  # steps recorded after the warm-up: the test reads the fastest


def steps(layouts: list[dict[str, Any]], forward_s: float) -> list[dict[str, Any]]:
    """For each layout: one warm-up step, then `RECORDED` steps, each from a barrier to the
    device's last task, with its device spans and busy seconds (the loss: the last step's)."""
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
        engine = ZeroPPEngine(model, launch_layout(config), loss_fn=lm_loss, example_args=example)
        ((x, y),) = make_batches(1)
        runs = []  # (start, end, busy seconds, spans) of each recorded step
        with install(device):
            for record in (False, *[True] * RECORDED):
                device.sync()
                dist.barrier()
                device.spans = []
                device.record, busy = record, device.busy
                start = time.perf_counter()
                loss = engine.train_step(x, target=y)
                device.sync()
                end = time.perf_counter()
                if record:
                    runs.append((start, end, device.busy - busy, list(device.spans)))
        out.append({
            "pp_rank": engine.dims.pp_rank, "loss": float(loss), "cpu_share": cpu_share(),
            "steps": [{"start": a, "end": b, "busy": c, "spans": d} for a, b, c, d in runs],
        })  # fmt: skip
    return out


def cpu_share(seconds: float = 0.1) -> float:
    """The share of a core this process gets now: CPU time over wall time of a busy loop (near 1
    when a core is free; a fraction when other processes compete for the cores)."""
    wall, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        pass
    return (time.process_time() - cpu) / (time.perf_counter() - wall)
