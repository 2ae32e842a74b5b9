"""Make traced pipeline stages a chain: stage k takes exactly stage k-1's outputs.

torch's tracing front end cuts a model's graph into stages, but a value computed in stage 0 may be
read directly by stage 2 (a skip edge). HF decoders do this: stage 0 computes the rotary cos/sin and
the causal mask once and every later stage reads them. `PipelineStage` only sends a stage's outputs
to the next stage, as that stage's positional inputs. So each stage is rewritten in place to also
output, after its own results, every earlier value a later stage still needs (a relay), and to take
as inputs exactly what the previous stage now outputs. Parameters, names and arithmetic are
unchanged; stages that already form a chain are left alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import fx, nn

__all__ = ["chain_stages"]

# A value flowing between stages: ("input", placeholder name) for a model input, or
# (stage index, output index) with output index None when the stage returns a single value.
_Key = tuple[Any, Any]


def chain_stages(split_gm: fx.GraphModule, stages: Sequence[nn.Module]) -> None:
    """Rewrite `stages` (the submodules of `split_gm`, in order) so that they form a chain."""
    calls = _stage_calls(split_gm, stages)
    last = len(stages) - 1
    args = [[_key(a, calls) for a in node.args] for node in calls]
    final = [_key(v, calls) for v in _flat(_output_node(split_gm.graph).args[0])]
    if any(key[0] != last for key in final):
        raise ValueError(
            "the traced model returns values computed before its last pipeline stage; a pipeline "
            "returns the last stage's outputs only. Use split='stack' or a split callable."
        )
    if all(args[k] == _outputs_of(stages[k - 1], k - 1) for k in range(1, len(stages))):
        return  # already a chain
    # live[b]: values made before stage b (or model inputs) that stage b or a later one reads.
    live: list[list[_Key]] = [list(dict.fromkeys(args[0]))]
    for b in range(1, len(stages)):
        later = [key for keys in args[b:] for key in keys]
        live.append([key for key in dict.fromkeys(later) if key[0] == "input" or key[0] < b])
    for key in (key for keys in live[1:] for key in keys):
        if key[0] == "input" and key not in live[0]:
            raise ValueError(
                f"model input '{key[1]}' is read by a later pipeline stage but not by the first "
                "one, so it cannot be relayed; use split='stack' or a split callable."
            )
    for k, stage in enumerate(stages):
        inputs = args[0] if k == 0 else live[k]
        _rewrite(stage, k, args[k], inputs, live[k + 1] if k < last else None)


def _rewrite(
    gm: nn.Module, k: int, old: list[_Key], inputs: list[_Key], outputs: list[_Key] | None
) -> None:
    """Stage k takes `inputs` (was: `old`) and returns `outputs` (None: unchanged)."""
    graph = _graph_of(gm, k)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    by_key: dict[_Key, fx.Node] = {}
    if inputs != old:
        with graph.inserting_before(placeholders[0] if placeholders else None):
            for i, key in enumerate(inputs):
                by_key[key] = graph.placeholder(f"relay_{i}")
        for node, key in zip(placeholders, old, strict=True):
            node.replace_all_uses_with(by_key[key])
            graph.erase_node(node)
    else:
        by_key = dict(zip(old, placeholders, strict=True))
    if outputs is not None:
        out = _output_node(graph)
        own: Any = out.args[0]  # the stage's output: a node, or a tuple of them
        values = [
            (own if key[1] is None else own[key[1]]) if key[0] == k else by_key[key]
            for key in outputs
        ]
        out.args = (tuple(values),)
    graph.lint()
    assert isinstance(gm, fx.GraphModule)
    gm.recompile()
    if "_out_spec" in gm.code:  # a pytree-structured output would no longer match its spec
        raise ValueError(f"traced stage {k} returns a pytree; cannot add relayed outputs to it")


def _stage_calls(split_gm: fx.GraphModule, stages: Sequence[nn.Module]) -> list[fx.Node]:
    calls = {
        id(split_gm.get_submodule(n.target)): n
        for n in split_gm.graph.nodes
        if n.op == "call_module"
    }
    nodes = [calls[id(s)] for s in stages]
    if any(node.kwargs for node in nodes):
        raise ValueError("a traced stage takes keyword arguments; cannot chain it")
    return nodes


def _key(value: Any, calls: list[fx.Node]) -> _Key:
    if isinstance(value, fx.Node) and value.op == "placeholder":
        return ("input", value.name)
    if isinstance(value, fx.Node) and value in calls:
        return (calls.index(value), None)
    if (
        isinstance(value, fx.Node)
        and value.op == "call_function"
        and len(value.args) == 2
        and isinstance(value.args[0], fx.Node)
        and value.args[0] in calls
        and isinstance(value.args[1], int)
    ):
        return (calls.index(value.args[0]), value.args[1])
    raise ValueError(f"cannot relay stage input {value!r}: it is not a model input or stage output")


def _outputs_of(stage: nn.Module, k: int) -> list[_Key]:
    """The keys of what stage k returns, in order."""
    own = _output_node(_graph_of(stage, k)).args[0]
    if isinstance(own, (tuple, list)):
        return [(k, i) for i in range(len(own))]
    return [(k, None)]


def _graph_of(stage: nn.Module, k: int) -> fx.Graph:
    if not isinstance(stage, fx.GraphModule):
        raise TypeError(f"traced stage {k} is a {type(stage).__name__}, not an fx.GraphModule")
    return stage.graph


def _output_node(graph: fx.Graph) -> fx.Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def _flat(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]
