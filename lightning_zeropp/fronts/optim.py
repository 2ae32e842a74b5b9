"""Move a user's optimizer and LR scheduler from the whole model onto this rank's pipeline stages.

Framework-free (torch only), for any loop-style front: the Accelerate front calls it from
`prepare_pipeline`, and steps the retargeted scheduler through its own `PipelineScheduler`
(`accelerate/optim.py`, Accelerate's stepping convention).

The user builds the optimizer (and scheduler) on the unsplit model, as in any Accelerate script.
The engine's stages hold new parameters (FSDP2 shards), so the optimizer is rebuilt: same class,
same defaults, same param groups in the same order with the same hyperparameters, each group
holding this rank's parameters of the original group, matched by name. Groups whose parameters
all live on other stages stay, empty, so that every rank has the same groups: the scheduler's
per-group state (`base_lrs`, ...) then means the same on every rank, and Accelerate's checkpoint of
it (written by rank 0, read by all) fits everywhere.

The scheduler is retargeted rather than rebuilt (its constructor arguments are not recoverable):
a shallow copy whose references to the old optimizer, and those of the schedulers it holds
(`SequentialLR`, `ChainedScheduler`), point to the new one. Its state (step count, `base_lrs`, the
lambdas) carries over, and the group hyperparameters the scheduler set at construction
(`initial_lr`, the warm-up's first `lr`) were copied with the groups.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import nn
from torch.optim import Optimizer

__all__ = [
    "OptimizerFactory",
    "SchedulerFactory",
    "optimizer_param_names",
    "rebuild_optimizer",
    "retarget_scheduler",
]

OptimizerFactory = Callable[[nn.Module], Optimizer]
SchedulerFactory = Callable[[Optimizer], Any]


def optimizer_param_names(optimizer: Optimizer, model: nn.Module) -> list[list[str]]:
    """Per param group, the model's names of its parameters; a tensor the model lacks is an error.

    A tensor the model holds under several names (tied embeddings) is listed under every name:
    the pipeline gives each stage its own copy under its own name (`core.split.tied`), and every
    copy must be stepped, with the same hyperparameters, to stay equal to the others.
    Runs before the engine is built (no collective), so every rank fails alike on a bad optimizer.
    """
    _check_fresh(optimizer)
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(
                f"{type(optimizer).__name__}.param_groups[{i}] holds {len(missing)} tensor(s) "
                f"(shapes {missing[:3]}) that are not parameters of the model given to "
                "prepare_pipeline; build the optimizer on that model's parameters."
            )
        groups.append([name for p in group["params"] for name in names[id(p)]])
    return groups


def rebuild_optimizer(
    optimizer: Optimizer, group_names: list[list[str]], params: Mapping[str, nn.Parameter]
) -> Optimizer:
    """The same optimizer over `params` (this rank's parameters by original name).

    Every group of `optimizer` becomes a group with the same hyperparameters holding those of its
    parameters found in `params` (possibly none), each tensor once (a stage holding several names
    of a tied weight holds them as one tensor).
    """
    groups = []
    for group, names in zip(optimizer.param_groups, group_names, strict=True):
        hyper = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        found = {id(params[n]): params[n] for n in names if n in params}
        groups.append({"params": list(found.values()), **hyper})
    cls = type(optimizer)
    try:
        new = cls(groups, **_constructor_kwargs(cls, optimizer.defaults))
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"cannot rebuild {cls.__name__} over the pipeline stages by calling "
            f"{cls.__name__}(param_groups, **defaults): {err}. Pass a factory instead: "
            f"prepare_pipeline(..., optimizer=lambda module: {cls.__name__}(module.parameters(), "
            "...)), called with this rank's stages (original parameter names)."
        ) from err
    # Defaults the constructor does not take as arguments (AdamW's decoupled_weight_decay) too.
    for key, value in optimizer.defaults.items():
        new.defaults.setdefault(key, copy.deepcopy(value))
    return new


def retarget_scheduler(scheduler: Any, old: Optimizer | None, new: Optimizer) -> Any:
    """`scheduler` (built on `old`) driving `new` instead, or `scheduler(new)` for a factory."""
    if _is_scheduler(scheduler):
        if old is None:
            raise TypeError(
                "with an optimizer factory there is no optimizer to retarget the scheduler from; "
                f"pass scheduler=lambda opt: {type(scheduler).__name__}(opt, ...)."
            )
        if scheduler.optimizer is not old:
            raise ValueError(
                f"the {type(scheduler).__name__} passed to prepare_pipeline drives another "
                "optimizer than the one passed with it; build it on that optimizer."
            )
        return _rebind(scheduler, old, new)
    if callable(scheduler):  # a factory: lambda opt: Scheduler(opt, ...)
        return scheduler(new)
    raise TypeError(
        f"scheduler={type(scheduler).__name__} is neither an LR scheduler (an object with an "
        "`optimizer` attribute and `step`/`state_dict`) nor a factory `lambda optimizer: ...`."
    )


# ------------------------------------------------------------------------------------ helpers
def _check_fresh(optimizer: Optimizer) -> None:
    wrapped = getattr(optimizer, "optimizer", None)
    if isinstance(wrapped, Optimizer):  # Accelerate's AcceleratedOptimizer, or a similar wrapper
        raise TypeError(
            f"the optimizer is a {type(optimizer).__name__} wrapping a {type(wrapped).__name__}; "
            "pass your own optimizer to prepare_pipeline, not one from accelerator.prepare "
            "(prepare_pipeline wraps it itself)."
        )
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer; pass one built "
            "on the model, or a factory `lambda module: Optimizer(module.parameters(), ...)`."
        )
    if optimizer.state:
        raise ValueError(
            f"the {type(optimizer).__name__} already has state (it has stepped); its state cannot "
            "move onto the sharded stages. Call prepare_pipeline before training, and resume "
            "with accelerator.load_state(...)."
        )


def _constructor_kwargs(cls: type[Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return copy.deepcopy(defaults)
    return {k: copy.deepcopy(v) for k, v in defaults.items() if k in params}


def _is_scheduler(obj: Any) -> bool:
    return isinstance(getattr(obj, "optimizer", None), Optimizer) and hasattr(obj, "step")


def _rebind(scheduler: Any, old: Optimizer, new: Optimizer) -> Any:
    """A shallow copy of `scheduler` (and of any scheduler it holds) pointing at `new`."""
    clone = copy.copy(scheduler)
    for key, value in vars(clone).items():
        if value is old:
            setattr(clone, key, new)
        elif _is_scheduler(value) and value.optimizer is old:
            setattr(clone, key, _rebind(value, old, new))
        elif isinstance(value, (list, tuple)):
            items = [
                _rebind(v, old, new) if _is_scheduler(v) and v.optimizer is old else v
                for v in value
            ]
            setattr(clone, key, type(value)(items) if isinstance(value, tuple) else items)
    for key, value in _references(clone):
        if value is old:
            raise TypeError(
                f"cannot retarget {type(scheduler).__name__}: its attribute {key!r} still refers "
                "to the original optimizer. Pass a factory instead: prepare_pipeline(..., "
                f"scheduler=lambda opt: {type(scheduler).__name__}(opt, ...))."
            )
    return clone


def _references(obj: Any) -> Iterator[tuple[str, Any]]:
    """Everything `obj` refers to one level down (through lists, tuples, dicts and weakrefs)."""
    for key, value in vars(obj).items():
        if isinstance(value, dict):
            items = list(value.values())
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            items = [value]
        for v in items:
            yield key, (v() if isinstance(v, weakref.ref) else v)
