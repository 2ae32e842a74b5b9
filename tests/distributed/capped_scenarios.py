"""A model larger than each rank may hold: built on meta, loaded from safetensors, trained.

A Llama of about 1.4B parameters (5.2 GiB of fp32 weights) on 4 ranks, pp 2 x dp_shard 2 under
the ZeroPP schedule, each rank in a memory cgroup capped below the whole model's size (root,
cgroup v1). Every rank records its gradients' sums over its own shard rows at each step; one
process training the whole model (`reference`) sums its gradients over the same rows: an oracle
for every gradient element's scale and place that needs no copy of the whole model per rank.

`write_weights` writes an HF directory of random weights tensor by tensor (never the whole
model in memory); `bench/bench_meta_memory.py` uses it too.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_zeropp.core.shard.fsdp import local_shard
from tests.distributed.cgroup import memory_cgroup

LAYOUT = {
    "pp_size": 2,
    "dp_shard_size": 2,
    "schedule": "zeropp",
    "num_chunks": 8,  # chunks of ~1.75 layers: one gathered at a time is ~0.33 GB
    "unit_size": 2,
    "num_microbatches": 2,
    "grad_reduce": "microbatch",  # unsharded gradients live for one chunk's backward only
}
SHAPE_1_4B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 4}  # fmt: skip
VOCAB, SEQ, ROWS, LR = 32000, 32, 4, 0.1


def llama_config(shape: dict[str, int]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False, **shape)


def write_weights(config: Any, out: Path) -> Path:
    """An HF directory of random weights for `config`, one safetensors file per layer, written
    tensor by tensor. Kept when already complete (the index is written last)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from lightning_zeropp.core.weights.materialize import empty_parameters

    if (out / "model.safetensors.index.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    with empty_parameters():
        model = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(0)
    part = lambda n: n.split(".")[2] if n.startswith("model.layers.") else "outer"  # noqa: E731
    weight_map: dict[str, str] = {}
    for name_of_part in dict.fromkeys(part(n) for n, _ in model.named_parameters()):
        tensors = {
            n: torch.ones(p.shape) if p.dim() == 1 else torch.randn(p.shape, generator=g) * 0.02
            for n, p in model.named_parameters()
            if part(n) == name_of_part
        }
        fname = f"model-{name_of_part}.safetensors"
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    config.save_pretrained(out)
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(steps)]


def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())


class AnonPeak:
    """The most anonymous memory (RssAnon: tensors, heap; not file pages) this process held,
    sampled every 5 ms by a daemon thread. The cgroup's own peak counts the page cache of the
    weight files read, which the kernel reclaims only when the cap is reached."""

    def __init__(self) -> None:
        self.peak = 0
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    self.peak = max(self.peak, int(line.split()[1]) * 1024)
            time.sleep(0.005)


def capped_train(weights: str, cap: int, steps: int) -> dict[str, Any]:
    """One rank (in its capped cgroup: `launch(memory_cap=...)`): build on meta, load its shards,
    train `steps` SGD steps recording its gradients' shard sums before each update."""
    from transformers import AutoModelForCausalLM

    from lightning_zeropp import launch_layout
    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
    from lightning_zeropp.core._torch_private import local_chunk
    from lightning_zeropp.core.weights.materialize import empty_parameters

    group = memory_cgroup(os.environ["RANK"])  # joined by the worker before any import
    cgroups = Path("/proc/self/cgroup").read_text().splitlines()  # "N:memory:/its-group"
    capped = any(line.endswith(f":/{group.name}") for line in cgroups)
    anon = AnonPeak()
    # A step of this model on 2 cores takes minutes: a pipeline rank may wait that long.
    dist.init_process_group("gloo", timeout=timedelta(minutes=15))
    config = ZeroPPConfig(**LAYOUT).resolve(dist.get_world_size())
    with empty_parameters():
        model = AutoModelForCausalLM.from_config(llama_config(SHAPE_1_4B))
    micro = ROWS // config.dp_size // config.num_microbatches
    example = (torch.zeros(micro, SEQ, dtype=torch.long),)
    engine = ZeroPPEngine(
        model, launch_layout(config), loss_fn=loss_fn, example_args=example, load_from=weights
    )
    del model
    opt = torch.optim.SGD(engine.parameters(), lr=LR)
    per = ROWS // engine.dims.dp_size
    rows = slice(engine.dims.dp_rank * per, (engine.dims.dp_rank + 1) * per)
    losses, sums = [], []
    for x in batches(steps):
        losses.append(float(engine.train_step(x[rows], target=x[rows])))
        sums.append(
            {
                n: (
                    [[s.start, s.stop] for s in local_chunk(p)],
                    float(local_shard(p.grad).double().sum()),
                    float(local_shard(p.grad).double().abs().sum()),
                )
                for n, p in engine.module.named_parameters()
            }
        )
        opt.step()
        opt.zero_grad()
    usage = group / "memory.max_usage_in_bytes"
    return {
        "capped": capped,
        "cap": cap,
        "cgroup_peak": int(usage.read_text()) if capped else None,
        "anon_peak": anon.peak,
        "shard_bytes": sum(local_shard(p).numel() * 4 for p in engine.parameters()),
        "losses": losses,
        "grad_sums": sums,
    }


def reference(weights: str, where: dict[str, list], steps: int) -> dict[str, Any]:
    """One process, the whole model: the same steps; its gradients summed over each rank's rows
    (`where`: name -> the [start, stop] per dimension of each rank's shard of it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    model.config.use_cache = False
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    params = dict(model.named_parameters())
    losses, sums = [], []
    for x in batches(steps):
        loss = loss_fn(model(x), x)
        loss.backward()
        losses.append(float(loss))
        step_sums = {}
        for name, chunks in where.items():
            grad = params[name].grad.double()
            step_sums[name] = [
                (float(part.sum()), float(part.abs().sum()))
                for part in (grad[tuple(slice(a, b) for a, b in chunk)] for chunk in chunks)
            ]
        sums.append(step_sums)
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grad_sums": sums}
