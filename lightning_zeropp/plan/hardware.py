"""What the step-time model assumes of the machine: compute rate, links, and whether collectives
overlap compute; read from a `conf/cluster/` file, given, or measured on this machine.

Rates are per rank (one GPU, or one CPU process). Link bandwidths are bytes per second per rank in
each direction, as `conf/cluster/*.yaml` documents them; a group of ranks that spans nodes runs at
the cross-node rate (its slowest link).

The compute rate is a share of the peak (`efficiency`) that depends on how the blocks run: eager,
or compiled (`torch.compile`, or fused kernels such as Transformer Engine's). A cluster file gives
a (low, high) share per mode, backed out of published runs (`plan.published`); a prediction is
then a range, and its central figure uses the middle of it. torch 2.13 refuses compiled stages
under split backward (ZB-V, interleaved zero bubble, DualPipeV, ZeroPP's default); with
`compile=True` this library compiles there only the regions between the blocks' weights
(`core.shard.compile`): the matmuls stay eager. No published run measures that, so its range
("regions", `compile_mode`) spans eager's low end to compiled's high end unless a cluster file
gives one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_zeropp.core.settings.placement import SPLIT_BACKWARD_SCHEDULES

__all__ = [
    "Hardware",
    "SPLIT_BACKWARD",
    "compile_mode",
    "measure_matmul_rate",
    "measure_memory_bandwidth",
    "measure_optimizer_rate",
]

GB = 1e9
BOUNDS = ("low", "mid", "high")
# torch's schedules whose backward is always split into input and weight tasks
SPLIT_BACKWARD = SPLIT_BACKWARD_SCHEDULES


MODES = ("eager", "compiled", "regions")


def compile_mode(config: Any, compiled: bool | None = None) -> str:
    """How a resolved config's blocks run: "eager"; "compiled" (whole blocks); or "regions"
    where the backward is split into input and weight tasks (`core.shard.compile` compiles
    only the regions between the weights there). `compiled` None: the config's `compile`."""
    if not (config.compile if compiled is None else compiled):
        return "eager"
    splits = config.schedule in SPLIT_BACKWARD or (
        config.schedule == "zeropp" and bool(config.split_backward)
    )
    return "regions" if splits else "compiled"


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
    # Share of `peak_flops_per_s` sustained, (low, high) by mode ("eager", "compiled"); None:
    # `flops_per_s` whatever the mode (a measured or given rate).
    efficiency: Mapping[str, tuple[float, float]] | None = None
    # Adapters of a node one collective's ring uses across nodes: None, one per member rank of
    # the node (NCCL runs a ring per adapter); gloo runs one ring (1).
    rings: int | None = None

    # The host link (PCIe) bytes/s per rank, each direction: what activation offload moves over
    # (`bandwidth_GBps.host` in a cluster file); None: not given, offload is not priced.
    host_Bps: float | None = None
    # Measured (latency, bytes/s) per hop of "all_gather", "reduce_scatter" and "p2p", used for
    # every group instead of the link figures (one machine's gloo, whose collectives run well
    # below its point-to-point rate).
    collectives: Mapping[str, tuple[float, float]] | None = None

    @property
    def optimizer_rate(self) -> float:
        return self.optimizer_Bps or self.memory_Bps / 7

    def hop(
        self, kind: str, first_rank: int, last_rank: int, per_node: int = 1
    ) -> tuple[float, float]:
        """(latency, bytes/s) of one hop of collective `kind` over ranks `first`..`last`, with
        `per_node` of the group's ranks in each node it spans (see `link`)."""
        if self.collectives and kind in self.collectives:
            return self.collectives[kind]
        return self.latency_s, self.link(first_rank, last_rank, per_node)

    def link(self, first_rank: int, last_rank: int, per_node: int = 1) -> float:
        """Bandwidth of one hop of a ring over a group whose ranks span `first_rank`..
        `last_rank`: the node's links inside a node; across nodes, the inter-node link of each
        of the group's `per_node` ranks in a node (one adapter per GPU, as on a DGX: NCCL runs
        a ring per adapter, each carrying its share of the data), up to the node's own links."""
        same = first_rank // self.node_size == last_rank // self.node_size
        if same:
            return self.intra_node_Bps
        adapters = max(min(per_node, self.rings or per_node), 1)
        return min(self.intra_node_Bps, self.inter_node_Bps * adapters)

    def with_rate(self, flops_per_s: float) -> Hardware:
        return replace(self, flops_per_s=flops_per_s)

    def at(self, mode: str | bool, bound: str = "mid") -> Hardware:
        """This machine computing in `mode` ("eager", "compiled", "regions"; a bool: compiled
        or eager), at the `bound` ("low", "mid", "high") of its efficiency range; itself when
        it has no range."""
        mode = mode if isinstance(mode, str) else ("compiled" if mode else "eager")
        if bound not in BOUNDS or mode not in MODES:
            raise ValueError(f"mode={mode!r}, bound={bound!r}; use one of {MODES}, {BOUNDS}.")
        if not self.efficiency:
            return self
        # one object per mode and bound: what is priced for it can be cached by identity
        memo = self.__dict__.setdefault("_at", {})
        if (mode, bound) not in memo:
            low, high = self.efficiency[mode]
            share = {"low": low, "mid": (low + high) / 2, "high": high}[bound]
            peak = self.peak_flops_per_s or self.flops_per_s
            memo[mode, bound] = replace(self, flops_per_s=peak * share)
        return memo[mode, bound]

    @classmethod
    def from_cluster(cls, cluster: Mapping[str, Any], dtype: str = "bf16") -> Hardware:
        """From a `conf/cluster/` mapping: `devices` per node, `bandwidth_GBps` (intra_node,
        inter_node, and host: the host link activation offload uses), and its `planner` block (`peak_tflops` by dtype, `efficiency`,
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
        shares = _efficiency(name, figures.get("efficiency", 0.5))
        return cls(
            flops_per_s=peak_flops * sum(shares["eager"]) / 2,
            efficiency=shares,
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
            host_Bps=float(bandwidth["host"]) * GB if bandwidth.get("host") else None,
        )


def _efficiency(name: Any, value: Any) -> dict[str, tuple[float, float]]:
    """A cluster file's `planner.efficiency`: one share for every mode, or per mode ("eager",
    "compiled", optionally "regions") a share or a [low, high] pair."""
    per_mode = value if isinstance(value, Mapping) else {"eager": value, "compiled": value}
    out = {}
    for mode in ("eager", "compiled"):
        given = per_mode.get(mode, per_mode.get("eager"))
        pair = (
            tuple(given)
            if isinstance(given, Sequence) and not isinstance(given, str)
            else (given, given)
        )
        if len(pair) != 2 or not all(isinstance(x, int | float) and 0 < x <= 1 for x in pair):
            raise ValueError(
                f"cluster {name!r}: planner.efficiency.{mode}={given!r} must be a share of peak "
                "in (0, 1] or a [low, high] pair of them."
            )
        low, high = sorted(float(x) for x in pair)
        out[mode] = (low, high)
    given = per_mode.get("regions")
    if given is None:  # unmeasured: between eager (its matmuls) and compiled
        out["regions"] = (out["eager"][0], out["compiled"][1])
    else:
        pair = (
            tuple(given)
            if isinstance(given, Sequence) and not isinstance(given, str)
            else (given, given)
        )
        out["regions"] = (float(min(pair)), float(max(pair)))
    return out


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
