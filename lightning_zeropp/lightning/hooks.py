"""Lightning's hooks and callbacks that read the model, under a pipeline.

Each rank holds the parameters and gradients of its pipeline stages only, each sharded over the
data-parallel ranks. So in `on_after_backward` and `on_before_optimizer_step` (of the module and of
callbacks) a norm, sum or maximum over `self.parameters()` or their gradients would be this rank's
share of it, logged as if it were the model's: `ShardReads` refuses any such reduction with a
message naming `grad_norm`, this library's whole-model version of Lightning's `grad_norm`.
Outside a step a rank holds no value for a parameter of another stage (`lightning.network`
guards it): `full_parameter` and `param_norm` gather one from the stage holding it, on every rank.
Element-wise work (clamping gradients, an EMA of the weights) is per element and stays allowed.

`ThroughputMonitor` counts every rank as a device reading its own batch; the ranks of one pipeline
read one batch, so it counts pipelines (`count_pipelines`).
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ThroughputMonitor
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from lightning_zeropp.core._torch_private import tree_flatten

__all__ = ["ShardReads", "count_pipelines", "full_parameter", "grad_norm", "param_norm"]

# Tensor queries that read no values (a shard's shape is its parameter's, under DTensor).
_METADATA = {
    "size", "dim", "ndimension", "numel", "nelement", "__len__", "stride", "element_size",
    "is_floating_point", "is_complex", "is_contiguous", "get_device", "storage_offset",
    "data_ptr", "__format__", "__repr__", "__get__", "__set__", "requires_grad_", "detach",
}  # fmt: skip


class ShardReads(TorchFunctionMode):
    """Refuses reductions of the module's parameters or gradients (see the module docstring)."""

    _allowed = 0  # inside this library's own whole-model reads (`allowed`)

    @classmethod
    @contextlib.contextmanager
    def allowed(cls) -> Iterator[None]:
        cls._allowed += 1
        try:
            yield
        finally:
            cls._allowed -= 1

    def __init__(self, module: pl.LightningModule, hook: str) -> None:
        super().__init__()
        self.hook = hook
        self.names: dict[int, str] = {}
        for name, p in module.named_parameters():
            self.names[id(p)] = name
            if p.grad is not None:
                self.names[id(p.grad)] = f"{name} (gradient)"
        self._derived: dict[int, tuple[torch.Tensor, str]] = {}

    def _source(self, leaves: list[Any]) -> tuple[str, int] | None:
        for t in leaves:
            if not isinstance(t, torch.Tensor):
                continue
            name = self.names.get(id(t))
            if name is None and id(t) in self._derived and self._derived[id(t)][0] is t:
                name = self._derived[id(t)][1]
            if name is not None:
                return name, t.numel()
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        source = self._source(tree_flatten((args, kwargs))[0]) if not self._allowed else None
        if source is None:
            return out
        what = getattr(func, "__name__", str(func))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if what not in _METADATA and (not outs or any(t.numel() < source[1] for t in outs)):
            raise ValueError(
                f"{self.hook} reduces {source[0]} ({what}): under ZeroPPStrategy this rank holds "
                "the parameters and gradients of its pipeline stages only, sharded over "
                "data-parallel ranks, so that would be this rank's share, not the model's. For "
                "Lightning's grad_norm over the whole model use lightning_zeropp.grad_norm(self, "
                "norm_type) (on every rank); clip with the Trainer's gradient_clip_val."
            )
        for t in outs:
            self._derived[id(t)] = (t, source[0])
        return out


def grad_norm(
    module: pl.LightningModule, norm_type: float | str = 2.0, group_separator: str = "/"
) -> dict[str, torch.Tensor]:
    """Lightning's `grad_norm(module, norm_type)` under `ZeroPPStrategy`: the norm of each
    parameter's whole gradient (every shard) and their total over the whole model (every stage),
    the same dict on every rank, keyed as Lightning keys it. Collective: call it on every rank
    (e.g. in `on_before_optimizer_step`). A tied weight counts once, under its first name."""
    return _norms(module, norm_type, group_separator, "grad", lambda p: p.grad)


def param_norm(
    module: pl.LightningModule, norm_type: float | str = 2.0, group_separator: str = "/"
) -> dict[str, torch.Tensor]:
    """`grad_norm` for the weights: the norm of each whole parameter (every shard, every stage)
    and their total, keyed `param_{norm_type}_norm/<name>` and `param_{norm_type}_norm_total`,
    the same dict on every rank (log it from any rank). Collective: call it on every rank, in
    any hook or after `trainer.fit`. A tied weight counts once, under its first name."""
    return _norms(module, norm_type, group_separator, "param", lambda p: p)


def full_parameter(module: pl.LightningModule, name: str) -> torch.Tensor:
    """The trained value of the parameter `name` (as `module.named_parameters()` names it in one
    process, e.g. "model.head.weight" or "logit_scale"): whole (every shard), on every rank, as a
    CPU tensor, from the pipeline stage holding it. Collective: call it on every rank, in any
    hook or after `trainer.fit`. Meant for single parameters (a scale, a norm to log); the whole
    model is `trainer.strategy.full_state_dict()`."""
    strategy: Any = module.trainer.strategy  # a ZeroPPStrategy
    engine, names = strategy.engine, strategy._runner.network.names
    held = dict(module.named_parameters(remove_duplicate=False))
    if name not in names and name not in held:  # the same answer on every rank: no collective
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}" if close else ""
        raise ValueError(
            f"full_parameter: {type(module).__name__} has no parameter {name!r}{hint} (names as "
            "module.named_parameters() gives them in one process)."
        )
    value = None
    if name in held:
        with ShardReads.allowed():
            p = held[name].detach()
            value = (p.full_tensor() if isinstance(p, DTensor) else p).cpu().clone()
    gathered: list[Any] = [None] * engine.config.pp_size
    dist.all_gather_object(gathered, value, group=engine.dims.pp_group)
    return next(v for v in gathered if v is not None)


def _norms(
    module: pl.LightningModule,
    norm_type: float | str,
    group_separator: str,
    kind: str,
    read: Callable[[torch.Tensor], torch.Tensor | None],
) -> dict[str, torch.Tensor]:
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be a positive number or 'inf'; got {norm_type}")
    strategy: Any = module.trainer.strategy  # a ZeroPPStrategy
    engine = strategy.engine
    counted = {id(p) for p in engine.counted_parameters()}
    names, norms = [], []
    with ShardReads.allowed():
        for name, p in module.named_parameters():
            value = read(p)
            if value is None or id(p) not in counted:
                continue
            norm = torch.linalg.vector_norm(value.detach(), norm_type)
            names.append(name)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        local = torch.stack(norms).float().cpu().tolist() if norms else []
    gathered: list[Any] = [None] * engine.config.pp_size
    dist.all_gather_object(
        gathered, list(zip(names, local, strict=True)), group=engine.dims.pp_group
    )
    prefix = f"{kind}_{norm_type}_norm"
    out = {f"{prefix}{group_separator}{n}": torch.tensor(v) for part in gathered for n, v in part}
    if out:
        out[f"{prefix}_total"] = torch.stack(list(out.values())).norm(norm_type)
    return out


def count_pipelines(trainer: pl.Trainer, pipelines: int) -> None:
    """Make `ThroughputMonitor` count pipelines, not ranks (see the module docstring)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's connector
        if isinstance(callback, ThroughputMonitor):
            for throughput in callback._throughputs.values():
                throughput.world_size = pipelines
