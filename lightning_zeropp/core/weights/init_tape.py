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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_zeropp.core._torch_private import local_chunk, tree_flatten, tree_map
from lightning_zeropp.core.shard.fsdp import local_shard

__all__ = [
    "InitTape",
    "draws",
    "get_states",
    "replay_into",
    "same_states",
    "set_states",
    "shared_start",
    "targets_by_ref",
    "tensors",
    "unrecorded",
]

# Calls that draw from a generator (names, as the torch-function mode sees them).
_DRAWS = {
    "uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
    "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_", "bernoulli_", "random_",
    "exponential_", "geometric_", "log_normal_", "cauchy_", "bernoulli", "multinomial",
    "normal", "poisson", "randperm", "dropout",
}  # fmt: skip


def draws(name: str) -> bool:
    """Whether a call of this name draws from a random generator."""
    return name in _DRAWS or name.startswith("rand")


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
        set_states(start)
        for i, call in enumerate(self.calls):
            if not call.draws:
                continue
            states[i] = get_states()
            env: dict[int, torch.Tensor] = {}
            args, kwargs = tree_map(_scratch, self._decode(call.args, env, device))
            with torch.no_grad():
                call.func(*args, **kwargs)
        states[-1] = get_states()  # where the eager build left the generators
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
                set_states(states[i])
            args, kwargs = self._decode(call.args, env, device)
            with torch.no_grad():
                out = call.func(*args, **kwargs)
            for ref, value in zip(call.outs, tensors(out), strict=False):
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
    saved = get_states()
    try:
        yield
    finally:
        set_states(saved)


def same_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def get_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_states(states: dict[str, torch.Tensor]) -> None:
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


def unrecorded(
    stages: Sequence[nn.Module], refs: dict[str, int]
) -> Callable[[nn.Module, str, torch.Tensor], bool]:
    """`materialize`'s `only=`: the tensors the constructor's recorded init does not set."""
    covered = {
        (id(module), name)
        for stage in stages
        for prefix, module in stage.named_modules()
        for name in module._parameters
        if (f"{prefix}.{name}" if prefix else name) in refs
    }
    return lambda module, name, tensor: (id(module), name) not in covered


def replay_into(
    stages: Sequence[nn.Module], recorded: tuple[InitTape, dict[str, int]], device: torch.device
) -> None:
    """The constructor's init on this rank's shards (`core.weights.init_tape`)."""
    tape, refs = recorded
    targets = targets_by_ref(stages, refs)
    current = get_states()
    bad, end = tape.replay(targets, device, shared_start(tape, device))
    if bad:
        names = sorted(n for n, r in refs.items() if r in bad)
        raise ValueError(
            f"the init {type(stages[0]).__name__}'s constructor applies to {names[:4]} cannot "
            "be replayed on the shards (it computes with a meta tensor that is not a parameter); "
            "give ZeroPPStrategy / the engine init=fn (called per module) or load_from=..."
        )
    if same_states(current, tape.end):  # nothing drew since: continue where eager would be
        set_states(end)
