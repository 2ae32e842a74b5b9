"""What the step-time model assumes of the machine: compute rate, links, and whether collectives
overlap compute; read from a `conf/cluster/` file, given, or measured on this machine.

Rates are per rank (one GPU, or one CPU process). Link bandwidths are bytes per second per rank in
each direction, as `conf/cluster/*.yaml` documents them; a group of ranks that spans nodes runs at
the cross-node rate (its slowest link).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["Hardware", "measure_matmul_rate", "measure_memory_bandwidth", "measure_optimizer_rate"]

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One rank's machine as the model sees it."""

    flops_per_s: float  # sustained rate of the model's math in the compute dtype
    intra_node_Bps: float  # link bytes/s per rank, each direction, inside a node
    inter_node_Bps: float  # ... between nodes
    node_size: int  # ranks per node
    latency_s: float = 5e-6  # per message hop
    unit_overhead_s: float = 0.0  # fixed seconds per FSDP unit of every compute task (hooks)
    memory_Bps: float = 2e12  # device memory bandwidth (the optimizer step streams the state)
    overlap: bool = True  # collectives on their own stream, overlapping compute (GPUs)
    peak_flops_per_s: float | None = None  # for MFU; default `flops_per_s`
    memory_bytes: int | None = None  # per rank, for the search (what a run may use of it)
    dtype: str | None = None  # the compute dtype `flops_per_s` is for ("bf16", "fp32", ...)
    optimizer_Bps: float | None = None  # parameter bytes the optimizer updates per second;
    # default: AdamW streaming its state once (`memory_Bps` / 7: 28 bytes moved per fp32 parameter)

    # Measured (latency, bytes/s) per hop of "all_gather", "reduce_scatter" and "p2p", used for
    # every group instead of the link figures (one machine's gloo, whose collectives run well
    # below its point-to-point rate).
    collectives: Mapping[str, tuple[float, float]] | None = None

    @property
    def optimizer_rate(self) -> float:
        return self.optimizer_Bps or self.memory_Bps / 7

    def hop(self, kind: str, first_rank: int, last_rank: int) -> tuple[float, float]:
        """(latency, bytes/s) of one hop of collective `kind` over ranks `first`..`last`."""
        if self.collectives and kind in self.collectives:
            return self.collectives[kind]
        return self.latency_s, self.link(first_rank, last_rank)

    def link(self, first_rank: int, last_rank: int) -> float:
        """Bandwidth of a group whose ranks span `first_rank`..`last_rank`."""
        same = first_rank // self.node_size == last_rank // self.node_size
        return self.intra_node_Bps if same else self.inter_node_Bps

    def with_rate(self, flops_per_s: float) -> Hardware:
        return replace(self, flops_per_s=flops_per_s)

    @classmethod
    def from_cluster(cls, cluster: Mapping[str, Any], dtype: str = "bf16") -> Hardware:
        """From a `conf/cluster/` mapping: `devices` per node, `bandwidth_GBps` (intra_node,
        inter_node), and its `planner` block (`peak_tflops` by dtype, `efficiency`,
        `memory_GiB`, `memory_bandwidth_GBps`, `latency_us`, `unit_overhead_us`); `dtype` is the
        compute dtype."""
        name = cluster.get("name")
        bandwidth = cluster.get("bandwidth_GBps") or {}
        figures = cluster.get("planner") or {}
        intra, inter = bandwidth.get("intra_node"), bandwidth.get("inter_node")
        peaks = figures.get("peak_tflops") or {}
        if intra is None or not peaks:
            raise ValueError(
                f"cluster {name!r} gives no bandwidth_GBps.intra_node or planner.peak_tflops; the "
                "planner needs both (see conf/cluster/h100_4x8.yaml)."
            )
        if peaks.get(dtype) is None:
            raise ValueError(
                f"cluster {name!r} gives no planner.peak_tflops.{dtype}; it has "
                f"{sorted(k for k, v in peaks.items() if v is not None)}."
            )
        peak_flops = float(peaks[dtype]) * 1e12
        memory = figures.get("memory_GiB")
        usable = float(figures.get("usable_fraction", 1.0))  # context, fragmentation, buffers
        return cls(
            flops_per_s=peak_flops * float(figures.get("efficiency", 0.5)),
            intra_node_Bps=float(intra) * GB,
            inter_node_Bps=float(inter if inter is not None else intra) * GB,
            node_size=int(cluster["devices"]),
            latency_s=float(figures.get("latency_us", 10)) * 1e-6,
            unit_overhead_s=float(figures.get("unit_overhead_us", 0)) * 1e-6,
            memory_Bps=float(figures.get("memory_bandwidth_GBps", 2000)) * GB,
            overlap=cluster.get("accelerator", "gpu") != "cpu",
            peak_flops_per_s=peak_flops,
            memory_bytes=int(float(memory) * 2**30 * usable) if memory else None,
            dtype=dtype,
        )


def measure_matmul_rate(m: int = 1024, k: int = 1024, n: int = 1024, repeat: int = 20) -> float:
    """FLOP/s of one fp32 matmul of m x k by k x n on this process's CPU threads."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b  # warm up the kernel choice
    start = time.perf_counter()
    for _ in range(repeat):
        a @ b
    return 2.0 * m * k * n * repeat / (time.perf_counter() - start)


def measure_memory_bandwidth(numel: int = 2**24, repeat: int = 10) -> float:
    """Bytes/s of a large copy (read plus write) on this process's CPU threads."""
    import torch

    src, dst = torch.randn(numel), torch.empty(numel)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeat):
        dst.copy_(src)
    return 2.0 * numel * 4 * repeat / (time.perf_counter() - start)


def measure_optimizer_rate(numel: int = 2**22, tensors: int = 16, repeat: int = 5) -> float:
    """fp32 parameter bytes per second torch's AdamW (its defaults) updates on this process."""
    import torch

    params = [torch.nn.Parameter(torch.randn(numel // tensors)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params)
    opt.step()  # creates the state
    start = time.perf_counter()
    for _ in range(repeat):
        opt.step()
    return 4.0 * numel * repeat / (time.perf_counter() - start)
