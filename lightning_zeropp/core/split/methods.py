"""Cut a model into pipeline stages, keeping parameter names and the user's forward.

Four ways, one result (a list of stage modules whose parameters carry their original names, so
checkpoints do not depend on the layout):

- `"call"` (what `"auto"` picks unless the model names another): the model's own forward, cut at
  its block calls, with no graph capture; any batch shape (see `core.split.call_plan`). Checked once on
  the meta device with one example micro-batch; a model it cannot split exactly is refused.

- `"trace"`: torch's tracing front end (`torch.distributed.pipelining.pipeline`) with split
  points at block boundaries. The user's forward is kept exactly as written. Needs one example
  micro-batch of inputs.
- `"stack"`: no tracing. Each stage is a pruned copy of the model: blocks outside the stage are
  removed (the remaining ones keep their names), modules registered before the block container go
  to the first stage only and modules after it to the last stage only (set to `None` elsewhere).
  Contract (torchtitan's): the model's forward iterates over its block container and skips
  modules that are `None`.
- a callable `split_fn(model, stage_index, num_stages, block_ranges) -> nn.Module`: anything else.

Which blocks each stage gets is `core.split.blocks`'s `BlockPlan`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from lightning_zeropp.core._torch_private import traced_dtype_checks
from lightning_zeropp.core.split.blocks import BlockPlan
from lightning_zeropp.core.split.call_plan import plan_calls
from lightning_zeropp.core.split.call_stages import build_call_stages
from lightning_zeropp.core.split.chain import chain_stages
from lightning_zeropp.core.split.dense import dense_boundaries
from lightning_zeropp.core.split.stack import check_stack, stack_stage

__all__ = [
    "SPLIT_ATTR",
    "SplitFn",
    "SplitMethod",
    "check_no_tied_parameters",
    "check_split",
    "resolve_split",
    "split_model",
]

SplitFn = Callable[[nn.Module, int, int, list[range]], nn.Module]
SplitMethod = Literal["auto", "call", "trace", "stack"] | SplitFn

# A model may name the split that suits it (e.g. HF decoders prepared by `models.hf`: "trace").
SPLIT_ATTR = "zeropp_split"


def resolve_split(model: nn.Module, method: SplitMethod) -> SplitMethod:
    """ "auto" is the model's own preference (`SPLIT_ATTR`), else "call"."""
    check_split(method)
    if method == "auto":
        return getattr(model, SPLIT_ATTR, "call")
    return method


def check_split(method: Any) -> None:
    """Refuse an unknown split name (fronts call it at construction, before any setup)."""
    if not callable(method) and method not in ("auto", "call", "trace", "stack"):
        raise ValueError(
            f"split={method!r} is unknown; use 'auto', 'call', 'trace', 'stack' or a callable."
        )


def split_model(
    model: nn.Module,
    plan: BlockPlan | None,
    stage_ids: Sequence[int],
    method: SplitMethod = "trace",
    example_args: tuple[Any, ...] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    call_inputs: Any = None,
    device: Any = None,
    dtype: torch.dtype | None = None,
) -> list[nn.Module]:
    """Build the stage modules `stage_ids` of `model` according to `plan`.

    `call_inputs` (a `CallInputs`) and `device` are for split="call" only; `dtype` is the
    parameters' compute dtype under mixed precision.
    """
    if plan is None:  # one stage of a model without blocks (`block_plan`): the whole model
        return [model]
    num_stages = len(plan.ranges)
    if num_stages == 1:
        return [model]
    if method == "call":
        calls = plan_calls(model, plan, example_args, example_kwargs)
        return build_call_stages(model, calls, stage_ids, call_inputs, device, dtype)
    if callable(method):
        stages = [method(model, s, num_stages, plan.ranges) for s in stage_ids]
    elif method == "stack":
        if example_args is not None or example_kwargs:
            check_stack(model, plan, example_args, example_kwargs)
        stages = [stack_stage(model, plan, s) for s in stage_ids]
    elif method == "trace":
        stages = _trace_stages(model, plan, stage_ids, example_args, example_kwargs, dtype)
    else:
        raise ValueError(f"split={method!r} is unknown; use 'trace', 'stack' or a callable.")
    for stage, s in zip(stages, stage_ids, strict=True):
        dense_boundaries(stage, first=s == 0, last=s == num_stages - 1)
    return stages


def _trace_stages(
    model: nn.Module,
    plan: BlockPlan,
    stage_ids: Sequence[int],
    example_args: tuple[Any, ...] | None,
    example_kwargs: dict[str, Any] | None,
    dtype: torch.dtype | None = None,
) -> list[nn.Module]:
    from torch.distributed.pipelining import SplitPoint, pipeline

    if example_args is None and not example_kwargs:
        raise ValueError(
            "split='trace' needs one example micro-batch of model inputs, shaped exactly like a "
            "real micro-batch (per-rank batch size / num_microbatches rows): pass example_args to "
            "the engine (in Lightning: set the module's example_input_array), or use split='stack'."
        )
    spec = {plan.fqn(r.start): SplitPoint.BEGINNING for r in plan.ranges[1:]}
    try:
        pipe = pipeline(
            model, mb_args=tuple(example_args or ()), mb_kwargs=example_kwargs, split_spec=spec
        )
    except Exception as err:  # torch.export's own message names no model and no way out
        raise ValueError(
            f"split='trace' cannot capture {type(model).__name__} as one graph: torch.export "
            f"failed ({_export_reason(err)}). Its forward has code a graph cannot hold (control "
            "flow on tensor values, e.g. nn.Transformer's causal-mask check). Use split='call' "
            "(the default), which runs the model's code as written, or a split callable."
        ) from err
    if pipe.num_stages != len(plan.ranges):
        raise ValueError(
            f"tracing produced {pipe.num_stages} stages instead of {len(plan.ranges)}; the block "
            f"container '{plan.container}' is probably not called in order by the forward. Use "
            "split='stack' or a split callable."
        )
    # Values read by a non-adjacent stage (e.g. HF's rotary cos/sin and causal mask) are relayed
    # through the stages in between: PipelineStage only feeds a stage its predecessor's outputs.
    stages = [pipe.get_stage_module(s) for s in range(pipe.num_stages)]
    chain_stages(pipe.split_gm, stages)
    if dtype is not None:
        _check_traced_dtypes(stages, dtype, type(model).__name__)
    return [stages[s] for s in stage_ids]


def _export_reason(err: BaseException) -> str:
    """The first line of torch.export's cause and the model's line that raised it."""
    cause = err.__cause__ or err
    lines = [line.strip() for line in str(cause).splitlines()]
    reason = f"{type(cause).__name__}: {lines[0] if lines else ''}"
    marker = "The following call raised this error:"
    if marker in lines and len(lines) > lines.index(marker) + 2:
        at = lines.index(marker)
        reason += f" at {lines[at + 1]}: {lines[at + 2]}"
    return reason


def _check_traced_dtypes(stages: list[nn.Module], dtype: torch.dtype, name: str) -> None:
    """A graph traced in float32 that checks an activation is float32 (a cast the model's code
    makes, a no-op when traced, e.g. HF's norms) fails once FSDP2 computes in `dtype`."""
    for index, stage in enumerate(stages):
        other = [d for d in traced_dtype_checks(stage) if d is not None and d.is_floating_point]
        other = [d for d in other if d != dtype]
        if other:
            raise ValueError(
                f"split='trace' cannot run {name} in param_dtype={dtype}: the graph of stage "
                f"{index}, traced in the parameters' dtype, checks that its activations are "
                f"{other[0]} (a cast in the model's code, a no-op when traced). Use split='call' "
                "(the default), which runs the model's code as written."
            )


def check_no_tied_parameters(model: nn.Module) -> None:
    """Tied weights are kept in sync by split="call" and "stack" only (see `core.split.tied`): a traced
    graph or a user's stage may share the one tensor between stages. Say so before splitting."""
    seen: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen and seen[id(p)] != name:
            raise ValueError(
                f"parameters '{seen[id(p)]}' and '{name}' are the same tensor (tied weights); "
                "split='trace' and split callables cannot share a parameter between pipeline "
                "stages. Use split='call' (the default for models that name no split) or "
                "'stack', which give each stage its own copy and keep the copies equal; or "
                "untie them (e.g. tie_word_embeddings=False)."
            )
        seen[id(p)] = name
