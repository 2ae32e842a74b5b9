"""torch.compile's internals (dynamo, inductor, AOTAutograd) for `core.shard.compile`, and the
dtype checks torch.export records in a traced graph (`core.split`).

torch._dynamo and torch._inductor are imported on first use: they take seconds to import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = [
    "aot_eager",
    "compile_errors",
    "compile_split_graph",
    "inductor",
    "keep_graph_compatible_backward",
    "set_compile_threads",
    "split_graph",
    "traced_dtype_checks",
]


def traced_dtype_checks(module: nn.Module) -> list[Any]:
    """The dtypes a traced graph (and the graphs of its submodules) asserts its tensors have:
    torch.export records a cast that was a no-op when traced (`x.to(torch.float32)` on a float32
    tensor) as `aten._assert_tensor_metadata`, not as a cast."""
    found = []
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        for node in graph.nodes if graph is not None else ():
            if node.op == "call_function" and "_assert_tensor_metadata" in str(node.target):
                found.append(node.kwargs.get("dtype"))
    return found


def compile_errors() -> tuple[type[BaseException], ...]:
    """What torch.compile raises when it cannot compile a frame (tracing or backend failures),
    before any of the frame's compiled code has run."""
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import InductorError

    return (TorchDynamoException, InductorError)


def inductor(gm: Any, example_inputs: list[Any]) -> Any:
    """Inductor on one graph, its backward lowered now rather than at the first backward (so a
    failure surfaces in the forward, where the block can still fall back to eager)."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    with functorch_config.patch(force_non_lazy_backward_lowering=True):
        return compile_fx(gm, example_inputs)


def aot_eager(gm: Any, example_inputs: list[Any]) -> Any:
    """AOTAutograd without code generation: the autograd nodes `inductor`'s graphs make, run by
    torch's own kernels (checks of how graphs are cut, without the compile time)."""
    from torch._dynamo.backends.debugging import aot_eager as _aot_eager

    return _aot_eager(gm, example_inputs)


def split_graph(gm: Any, partition: Callable[[Any], int]) -> Any:
    """`gm` cut into one submodule (`submod_<k>`) per partition id `partition(node)`."""
    from torch.fx.passes.split_module import split_module

    return split_module(gm, None, partition)  # type: ignore[arg-type]  # root_m is unused by torch


def compile_split_graph(split: Any, example_inputs: list[Any], compile_fn: Callable) -> Any:
    """Compile each submodule of `split` with `compile_fn(submodule, example_inputs)` (which may
    return it as is, to run eagerly), propagating fake tensors from one to the next: what
    torch's DDPOptimizer does with the graph it cuts at bucket boundaries, each piece becoming
    its own autograd node."""
    import torch
    from torch._dynamo.backends.distributed import SubmodCompiler
    from torch._dynamo.utils import _disable_saved_tensors_hooks_during_tracing
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode(example_inputs) or torch._subclasses.FakeTensorMode()
    with _disable_saved_tensors_hooks_during_tracing():
        SubmodCompiler(split, compile_fn, fake_mode).run(*example_inputs)
    split.recompile()
    return split


def keep_graph_compatible_backward() -> None:
    """Let compiled backwards run under `retain_graph=True`, as a split backward's input-gradient
    task runs them (the weight-gradient task reads the graph after it). Process-wide: AOTAutograd
    reads this flag when each backward runs, and a backward compiled with donated buffers (which
    reuses saved activations' memory for its outputs) refuses to run with the graph kept."""
    from torch._functorch import config as functorch_config

    functorch_config.donated_buffer = False


def set_compile_threads(threads: int) -> None:
    """Inductor's compile workers: 1 compiles in the calling process (no worker pool to start;
    what ranks sharing a few cores want)."""
    from torch._inductor import config as inductor_config

    inductor_config.compile_threads = threads
