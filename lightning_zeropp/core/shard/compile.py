"""`torch.compile` for a stage's blocks (`compile=True`): whole blocks, or the regions between
their weights when the schedule splits backward.

Each block's `forward` is compiled in place after the model is cut into stages, as torchtitan
compiles each transformer block: parameter names do not change, FSDP's hooks stay outside the
compiled code, and blocks of one class share their compiled code (dynamo captures one graph per
code object, with the parameters as inputs).

Whole blocks (`regions=False`, schedules with a full backward): dynamo captures the block's
forward as one graph; inductor compiles its forward and backward.

Regions (`regions=True`, schedules that split backward into input-gradient (I) and
weight-gradient (W) tasks: interleaved_zb, zbv, dualpipev, zeropp with split_backward). torch's
W re-enters the autograd graph where the weights' gradient paths leave the input-gradient path
and re-runs those nodes' backward. A compiled block is one autograd node whose backward yields
every gradient at once, so W would recompute the whole block's backward (torch refuses compiled
stages in these schedules for that reason). So the captured graph is cut: every op that reads a
parameter (matmuls, embeddings, norm scales, biases, and ops on values computed from parameters
alone) runs eagerly as its own autograd node, whose backward computes only the gradients asked
for; the ops between them (attention, rotary embeddings, the arithmetic of norms, activations,
residual adds) are compiled, in as few regions as their dependencies allow, each region its own
autograd node (the way torch's DDPOptimizer cuts graphs at bucket boundaries). No compiled
region produces a weight gradient: I runs the compiled regions' backward once, and W runs the
same eager weight-gradient kernels as without compile.

A block that cannot be compiled runs eagerly, with a warning naming it and the error.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from lightning_zeropp.core import _torch_private as tp

__all__ = ["compile_blocks", "compile_stats", "splits_backward", "SPLIT_BACKWARD_SCHEDULES"]

# torch's schedules whose backward is an input-gradient and a weight-gradient task (zeropp's is,
# with split_backward). A unit test checks this against the schedules' own actions.
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zb", "zbv", "dualpipev")

# Per process: dynamo graphs compiled ("graphs"), compiled regions and eager pieces of cut graphs
# ("regions", "eager_pieces"), runs of compiled whole blocks and of cut blocks ("whole_runs",
# "split_runs"), blocks fallen back to eager ("fallbacks"). Tests and benchmarks read them to know
# that compiled code ran.
_STATS: collections.Counter[str] = collections.Counter()


def compile_stats() -> dict[str, int]:
    """This process's compile counters (see `_STATS`)."""
    return dict(_STATS)


def splits_backward(schedule: str, split_backward: bool | None) -> bool:
    """Whether a (resolved) schedule runs separate input- and weight-gradient tasks."""
    return schedule in SPLIT_BACKWARD_SCHEDULES or bool(split_backward)


def compile_blocks(stage: nn.Module, block_names: Sequence[str], *, regions: bool) -> None:
    """Compile the `forward` of each named block of `stage` in place (see the module docstring).

    Call before activation checkpointing wraps the blocks (the checkpoint then recomputes the
    compiled forward) and before sharding (FSDP's hooks run around the compiled forward).
    """
    if regions:
        tp.keep_graph_compatible_backward()
    for name in block_names:
        block = stage.get_submodule(name)
        block.forward = _CompiledForward(name, block.forward, regions)


class _CompiledForward:
    """A block's forward compiled on first call; eager from then on if compiling fails."""

    def __init__(self, name: str, forward: Callable[..., Any], regions: bool) -> None:
        self.name, self.eager, self.failed = name, forward, False
        backend = _regions_backend if regions else _whole_backend
        # fullgraph: one graph per block, so a failure happens before any of it has run and the
        # eager forward can take over without running a part twice.
        self.compiled = torch.compile(forward, backend=backend, fullgraph=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.failed:
            try:
                return self.compiled(*args, **kwargs)
            except tp.compile_errors() as err:
                self.failed = True
                _STATS["fallbacks"] += 1
                first = (str(err).strip().splitlines() or [""])[0]
                warnings.warn(
                    f"compile=True: block '{self.name}' could not be compiled "
                    f"({type(err).__name__}: {first}); it runs eagerly from now on. The other "
                    "blocks stay compiled; compile=False runs every block eagerly.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return self.eager(*args, **kwargs)


def _whole_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    _STATS["graphs"] += 1
    return _counted(tp.inductor(gm, example_inputs), "whole_runs")


def _regions_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """The captured block cut into eager pieces (ops reading parameters) and compiled regions."""
    _STATS["graphs"] += 1
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    weights = {
        node
        for node, value in zip(placeholders, example_inputs, strict=True)
        if isinstance(value, nn.Parameter) and value.requires_grad
    }
    parts, eager = partition(gm.graph, weights)
    if not eager or not torch.is_grad_enabled():  # no weight gradient to keep apart
        return _counted(tp.inductor(gm, example_inputs), "split_runs")
    split = tp.split_graph(gm, lambda node: parts[node])
    eager_names = {f"submod_{parts[node]}" for node in eager}

    def compile_piece(piece: fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        if piece in eager_pieces:
            _STATS["eager_pieces"] += 1
            return piece
        _STATS["regions"] += 1
        return tp.inductor(piece, inputs)

    eager_pieces = [m for name, m in split.named_children() if name in eager_names]
    return _counted(tp.compile_split_graph(split, example_inputs, compile_piece), "split_runs")


def partition(graph: fx.Graph, weights: set[fx.Node]) -> tuple[dict[fx.Node, int], set[fx.Node]]:
    """Each op's piece, and the ops that run eagerly: those reading a weight or a value computed
    from weights alone ("weight side").

    Pieces run in order 0, 1, 2, ...: compiled region k has id 2k, the eager ops of level k id
    2k - 1. An op's level is the number of eager ops on the longest chain of its activation
    inputs (an eager op adds one), so a region holds every compiled op that needs no later eager
    op, and the eager ops of one level (say q, k and v projections) run between two regions.
    """
    weight_side, eager = set(weights), set()
    level: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            level[node] = 0
            continue
        inputs = node.all_input_nodes
        if inputs and all(a in weight_side for a in inputs):
            weight_side.add(node)  # e.g. weight.t(): with its first reader's eager ops
            eager.add(node)
            level[node] = 1
            continue
        base = max((level[a] for a in inputs if a not in weight_side), default=0)
        if any(a in weight_side for a in inputs):
            eager.add(node)
            level[node] = base + 1
        else:
            level[node] = base
    parts = {
        node: 2 * level[node] - 1 if node in eager else 2 * level[node]
        for node in graph.nodes
        if node.op not in ("placeholder", "output")
    }
    return parts, eager


def _counted(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
    """`fn` counting its runs under `key` (dynamo calls a backend's result with the graph's
    inputs)."""

    def run(*args: Any) -> Any:
        _STATS[key] += 1
        return fn(*args)

    return run
