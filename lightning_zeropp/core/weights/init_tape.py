"""The init a model's constructor applies, recorded while it is built on the meta device and replayed
on each rank's shards: the values an eager build from the same random state would give.

Built under `empty_parameters()`, a model's constructor runs its init (`reset_parameters()` of each
layer, then `self.apply(self._init_weights)`, zeroed projections, scaled residual weights...) on
meta tensors, where it does nothing. An `InitTape` records, in order, every torch call the
constructor makes on its parameters (and on values computed from them, such as `p.data`), and
every call that draws from a random generator, with the generators' state when construction began.

Replaying it gives each parameter the value the eager build gives, a parameter at a time:
1. every drawing call runs again in order, at its recorded shapes, on scratch tensors, from the
   recorded starting state: the generator goes through the states it went through eagerly, and
   the state before each draw is noted;
2. for each parameter (with the parameters a call reads along with it, a group), its calls run
   again on a whole scratch copy, each draw from its noted state, and every rank keeps its rows.
So the peak is a parameter group at full size, never the model; every layout gets the values one
process gets. A call the tape cannot replay (one on a meta tensor it did not see made) makes the
parameters it touches unreproducible: they are named, never silently given other values.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_zeropp.core._torch_private import local_chunk
from lightning_zeropp.core.shard.fsdp import local_shard

__all__ = [
    "InitTape",
    "follow_parameter",
    "recording",
    "same_states",
    "shared_start",
    "tape_of",
    "targets_by_ref",
]

# Calls that draw from a generator (names, as the torch-function mode sees them).
_DRAWS = {
    "uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
    "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_", "bernoulli_", "random_",
    "exponential_", "geometric_", "log_normal_", "cauchy_", "bernoulli", "multinomial",
    "normal", "poisson", "randperm", "dropout",
}  # fmt: skip

# id(parameter) -> (a weak reference to it, its tape, its ref): parameters hash by identity here
# (a WeakKeyDictionary would compare tensors by value).
_TAPES: dict[int, tuple[weakref.ref[torch.Tensor], InitTape, int]] = {}


@dataclass(frozen=True)
class _Ref:
    index: int  # a tensor the tape follows: a parameter, or a value computed from one


@dataclass
class _Call:
    func: Callable[..., Any]
    args: Any  # (args, kwargs) with followed tensors as `_Ref`s
    refs: frozenset[int]  # the followed tensors it reads or writes
    outs: tuple[int, ...]  # refs of its tensor outputs (in order; -1 for others)
    draws: bool
    foreign: bool  # reads a meta tensor the tape does not follow: not replayable


@dataclass
class InitTape:
    """One construction's calls (see the module docstring)."""

    start: dict[str, torch.Tensor]  # generator states when construction began
    end: dict[str, torch.Tensor] = field(default_factory=dict)  # ... and when it ended
    calls: list[_Call] = field(default_factory=list)
    shapes: list[tuple[torch.Size, torch.dtype]] = field(default_factory=list)  # per ref
    roots: dict[int, int] = field(default_factory=dict)  # ref -> the parameter ref it came from
    params: set[int] = field(default_factory=set)

    @torch.no_grad()
    def replay(
        self,
        targets: dict[int, list[torch.Tensor]],
        device: torch.device,
        start: dict[str, torch.Tensor] | None = None,
    ) -> tuple[set[int], dict[str, torch.Tensor]]:
        """Give each parameter ref in `targets` (ref -> this rank's sharded tensors holding it)
        its constructor's value, from `start` (default: the recorded one). Returns the refs it
        could not reproduce (left as they are) and the generators' states an eager build ends
        in. The generators are left as they were."""
        with _states_kept():
            states = self._draw_states(device, start or self.start)
            bad = {self.roots[r] for c in self.calls if c.foreign for r in c.refs}
            for group in self._groups(set(targets) - bad):
                self._replay_group(group, targets, states, device)
        return bad & set(targets), states[-1]

    def _draw_states(self, device: torch.device, start: dict[str, torch.Tensor]) -> dict[int, Any]:
        """Pass 1: every draw again, on scratch tensors; the state before each (by call)."""
        states: dict[int, Any] = {}
        _set_states(start)
        for i, call in enumerate(self.calls):
            if not call.draws:
                continue
            states[i] = _get_states()
            env: dict[int, torch.Tensor] = {}
            args, kwargs = tree_map(_scratch, self._decode(call.args, env, device))
            with torch.no_grad():
                call.func(*args, **kwargs)
        states[-1] = _get_states()  # where the eager build left the generators
        return states

    def _groups(self, wanted: set[int]) -> list[set[int]]:
        """Parameters whose calls read each other, joined (union of the roots per call)."""
        parent = {p: p for p in self.params}

        def find(p: int) -> int:
            while parent[p] != p:
                p = parent[p]
            return p

        for call in self.calls:
            roots = sorted({self.roots[r] for r in call.refs})
            for other in roots[1:]:
                parent[find(other)] = find(roots[0])
        groups: dict[int, set[int]] = {}
        for p in self.params:
            groups.setdefault(find(p), set()).add(p)
        return [g for g in groups.values() if g & wanted]

    def _replay_group(
        self,
        group: set[int],
        targets: dict[int, list[torch.Tensor]],
        states: dict[int, Any],
        device: torch.device,
    ) -> None:
        env: dict[int, torch.Tensor] = {}
        for i, call in enumerate(self.calls):
            if not {self.roots[r] for r in call.refs} & group:
                continue
            if call.draws:
                _set_states(states[i])
            args, kwargs = self._decode(call.args, env, device)
            with torch.no_grad():
                out = call.func(*args, **kwargs)
            for ref, value in zip(call.outs, _tensors(out), strict=False):
                if ref >= 0 and ref not in env:
                    env[ref] = value
        for ref in group & set(targets):
            whole = env.get(ref)
            for tensor in targets[ref]:
                local = local_shard(tensor)
                if whole is None:
                    continue  # never written: stays NaN, and `check_set` names it
                local.copy_(whole[local_chunk(tensor)].to(local.dtype))

    def _decode(self, encoded: Any, env: dict[int, torch.Tensor], device: torch.device) -> Any:
        def value(x: Any) -> Any:
            if not isinstance(x, _Ref):
                return x
            if x.index not in env:  # a parameter first touched here: uninitialized, as eagerly
                shape, dtype = self.shapes[x.index]
                env[x.index] = (
                    torch.full(shape, float("nan"), dtype=dtype, device=device)
                    if (dtype.is_floating_point)
                    else torch.zeros(shape, dtype=dtype, device=device)
                )
            return env[x.index]

        return tree_map(value, encoded)


class _Recorder(TorchFunctionMode):
    """Records the calls an `InitTape` needs while a model is built (see the module docstring)."""

    def __init__(self, tape: InitTape) -> None:
        super().__init__()
        self.tape = tape
        self.refs: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (tensor, ref)

    def follow(self, tensor: torch.Tensor, root: int | None = None) -> int:
        ref = len(self.tape.shapes)
        self.tape.shapes.append((tensor.shape, tensor.dtype))
        self.tape.roots[ref] = ref if root is None else root
        self.refs[id(tensor)] = (tensor, ref)
        return ref

    def ref_of(self, x: Any) -> int | None:
        found = self.refs.get(id(x)) if isinstance(x, torch.Tensor) else None
        return found[1] if found is not None and found[0] is x else None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.record(func, args, kwargs, out)
        return out

    def record(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any], out: Any) -> None:
        name = getattr(func, "__name__", "")
        leaves = tree_flatten((args, kwargs))[0]
        refs = {r for r in map(self.ref_of, leaves) if r is not None}
        draws = name in _DRAWS or name.startswith("rand")
        if not refs and not draws:
            return
        outs = _tensors(out)
        if refs and not outs and not draws:
            return  # a query (shape, dim, ...): nothing to replay
        foreign = any(
            isinstance(t, torch.Tensor) and t.is_meta and self.ref_of(t) is None for t in leaves
        )
        encoded = tree_map(
            lambda x: _Ref(r) if (r := self.ref_of(x)) is not None else x, (args, kwargs)
        )
        root = min((self.tape.roots[r] for r in refs), default=None)
        out_refs = []
        for t in outs:
            known = self.ref_of(t)
            out_refs.append(known if known is not None else (self.follow(t, root) if refs else -1))
        self.tape.calls.append(
            _Call(func, encoded, frozenset(refs), tuple(out_refs), draws, foreign)
        )


_active: list[_Recorder] = []

# `torch.nn.init` functions that do not pass through the torch-function mode as one call (they run
# their own ops, and some return at once on a meta tensor, or draw as many times as the values they
# draw require): while recording they are recorded whole, as one call each.
_WHOLE = (
    "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_normal_",
    "orthogonal_", "sparse_", "trunc_normal_",
)  # fmt: skip


@contextlib.contextmanager
def _whole_init_calls() -> Iterator[None]:
    originals = {name: getattr(nn.init, name) for name in _WHOLE}

    def whole(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            recorder = _active[-1] if _active else None
            if recorder is None or recorder.ref_of(tensor) is None:
                return original(tensor, *args, **kwargs)
            recorder.record(original, (tensor, *args), kwargs, tensor)
            return tensor

        return call

    for name, original in originals.items():
        setattr(nn.init, name, whole(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(nn.init, name, original)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Record the construction inside on a fresh tape (`empty_parameters` enters it)."""
    tape = InitTape(start=_get_states())
    recorder = _Recorder(tape)
    _active.append(recorder)
    try:
        with recorder, _whole_init_calls() if len(_active) == 1 else contextlib.nullcontext():
            yield
    finally:
        _active.remove(recorder)
        tape.end = _get_states()


def follow_parameter(param: torch.Tensor) -> None:
    """A parameter created on the meta device while recording: the tape follows it."""
    if _active:
        recorder = _active[-1]
        ref = recorder.follow(param)
        recorder.tape.params.add(ref)
        key = id(param)
        _TAPES[key] = (weakref.ref(param, lambda _: _TAPES.pop(key, None)), recorder.tape, ref)


def tape_of(model: nn.Module) -> tuple[InitTape, dict[str, int]] | None:
    """The tape that recorded `model`'s construction and each parameter name's ref in it."""
    found: dict[str, int] = {}
    tape = None
    for name, p in model.named_parameters(remove_duplicate=False):
        entry = _TAPES.get(id(p))
        if entry is None or entry[0]() is not p or (tape is not None and entry[1] is not tape):
            continue
        tape = entry[1]
        found[name] = entry[2]
    return (tape, found) if tape is not None else None


def shared_start(tape: InitTape, device: torch.device) -> dict[str, torch.Tensor]:
    """Rank 0's starting states on every rank (replicas must draw alike)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return tape.start
    out = {}
    for key, state in tape.start.items():
        moved = state.to(device)
        dist.broadcast(moved, src=0)
        out[key] = moved.cpu()
    return out


def _scratch(x: Any) -> Any:
    """A tensor's stand-in for a draw replayed only to move the generator on (never the user's
    own tensor: an in-place draw would write into it)."""
    return torch.empty_like(x) if isinstance(x, torch.Tensor) else x


@contextlib.contextmanager
def _states_kept() -> Iterator[None]:
    saved = _get_states()
    try:
        yield
    finally:
        _set_states(saved)


def same_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def _get_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_states(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


def targets_by_ref(
    stages: Sequence[nn.Module], refs: dict[str, int]
) -> dict[int, list[torch.Tensor]]:
    """This rank's stage tensors holding each parameter ref (by the model's names)."""
    out: dict[int, list[torch.Tensor]] = {}
    for stage in stages:
        for name, p in stage.named_parameters(remove_duplicate=False):
            if name in refs and all(p is not q for q in out.get(refs[name], [])):
                out.setdefault(refs[name], []).append(p)
    return out
