"""Where every value of a dry run came from: the check behind `split="call"` (see `call_plan`).

A torch-function mode tags each tensor with its sources (an outer module's output, a block's
output, an outer module's parameters, a random draw before the blocks) and records the first
read that the call split would get wrong on some stage: a block reading a value other than through its arguments, code after the
last block reading anything but its output, an outer module's weights read outside its call, or
such a value turned into a Python number.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_zeropp.core._torch_private import tree_flatten, tree_map

__all__ = ["Tagger"]


class Tagger(TorchFunctionMode):
    """Tags every tensor with the sources it was computed from; flags reads the split breaks."""

    def __init__(self, mixed: bool = False) -> None:
        super().__init__()
        # Meta weights and real inputs: an op mixing both runs on meta (values computed from the
        # inputs alone stay real and readable).
        self.mixed = mixed
        self.tags: dict[int, tuple[torch.Tensor, frozenset[Any]]] = {}
        self.inside: int | None = None  # the block whose forward is running
        self.after: int | None = None  # the last block, once it has returned
        self.units: list[str] = []  # outer modules whose forward is running
        self.started = False  # a block has been called
        self.leak: str | None = None
        # Parameters held outside any submodule: id -> name, and where the forward read each
        # ("before", "between" or "after" the blocks).
        self.bare: dict[int, str] = {}
        self.bare_reads: dict[str, set[str]] = {}
        # The parts ("part", block, position) of blocks' tuple returns read after the last
        # block: which of them may be (the last block's output, or extra values such as a
        # mixture-of-experts auxiliary loss, which the call split carries) is decided once the
        # chain is known (`call_plan._plan`).
        self.read_after: set[Any] = set()

    def add_bare(self, param: torch.Tensor, name: str) -> None:
        """Watch where the forward reads `param`, a parameter held outside any submodule. Read
        before the blocks it tags what it computes like an outer module's output (it must not
        reach past the blocks but through them); read after them it is the last stage's own."""
        self.bare[id(param)] = name
        self.bare_reads[name] = set()
        self.tag(param, frozenset({("bare", name)}))

    @property
    def phase(self) -> str:
        """Where the forward is: "before", "between" (or inside) or "after" the blocks."""
        if self.after is not None:
            return "after"
        return "between" if self.started else "before"

    def _read_bare(self, args: Any) -> frozenset[Any]:
        """Record the bare parameters read directly by this call; return the tags to drop."""
        drop = set()
        for t in tree_flatten(args)[0]:
            name = self.bare.get(id(t)) if isinstance(t, torch.Tensor) else None
            if name is None or self.tags.get(id(t), (None,))[0] is not t:
                continue
            where = self.phase
            self.bare_reads[name].add(where)
            if where == "after":
                drop.add(("bare", name))
        return frozenset(drop)

    def tag(self, x: Any, tags: frozenset[Any]) -> None:
        for t in tree_flatten(x)[0]:
            if isinstance(t, torch.Tensor):
                self.tags[id(t)] = (t, tags)

    def of(self, x: Any) -> frozenset[Any]:
        found: set[Any] = set()
        for t in tree_flatten(x)[0]:
            if isinstance(t, torch.Tensor) and id(t) in self.tags and self.tags[id(t)][0] is t:
                found |= self.tags[id(t)][1]
        return frozenset(found)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self.mixed and not _any_meta((args, kwargs)):
            # Tensors made "on the device of" a meta value (positions, masks) are made real.
            args, kwargs = tree_map(_real_device, (args, kwargs))
        if self.mixed and _mixes_meta((args, kwargs)):
            out = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        else:
            out = func(*args, **kwargs)
        tags = self.of((args, kwargs)) - self._read_bare((args, kwargs))
        what = getattr(func, "__name__", str(func))
        params = {t for t in tags if t[0] == "param"}
        for _, owners in params:  # an outer module's weights read outside its own call
            if not set(owners) & set(self.units) and self.leak is None:
                # A tied weight is each owner's own copy: a read inside any of them is safe.
                name = "' / '".join(owners)
                self.leak = (
                    f"its forward reads the parameters of '{name}' outside '{name}' ({what})"
                )
        tags = tags - params
        drawn = {t for t in tags if t[0] == "random"}
        if self.inside is None and self.after is None and _draws(what):
            # A random draw before the blocks differs between stages (each has its own
            # generator): a block argument computed from one is sent from the stage that drew
            # it, not redrawn (see `CallPlan.local`). That is all this tag decides.
            drawn.add(("random", what))
        tags = tags - drawn
        # A value computed inside a block is that block's stage's own: read elsewhere other
        # than through the block's return (a hook recording it, as HF records router logits
        # for the MoE load-balancing loss), another stage would read a stub's nothing.
        inner = frozenset({("inner", self.inside)}) if self.inside is not None else frozenset()
        if tags or drawn or inner:
            self.tag(out, tags | drawn | inner)
        if tags:
            self.check(tags, what)
            if (
                self.leak is None
                and what not in _METADATA
                and not _tensors_only(out)
                and not tags <= self.allowed_after | inner | self._parts_after(tags)
            ):
                # A Python number or flag read from a value another stage computes: on this
                # stage it would come from a stub (zeros), and tags cannot follow it.
                sources = ", ".join(sorted(_source_name(t) for t in tags))
                self.leak = f"its forward reads {sources} as a Python value ({what})"
        return out

    @property
    def allowed_after(self) -> frozenset[Any]:
        if self.after is None:
            return frozenset()
        return frozenset({("block", self.after), ("inner", self.after)})

    def _parts_after(self, tags: frozenset[Any]) -> frozenset[Any]:
        """The block-return parts among `tags` once the blocks are done (checked by the plan)."""
        if self.after is None:
            return frozenset()
        return frozenset(t for t in tags if t[0] == "part")

    def check(self, tags: frozenset[Any], what: str) -> None:
        allowed = frozenset({("inner", self.inside)}) if self.inside is not None else None
        if self.after is not None:
            parts = self._parts_after(tags)
            self.read_after |= parts
            allowed = self.allowed_after | parts
        if allowed is not None and not tags <= allowed and self.leak is None:
            where = f"block {self.inside}" if self.inside is not None else "after the last block"
            sources = ", ".join(sorted(_source_name(t) for t in tags - allowed))
            self.leak = (
                f"{where} reads a value computed from {sources} other than through the blocks' "
                f"arguments (in {what})"
            )


# Tensor queries that read no values: a stub's output has the real shape, dtype and device.
_METADATA = {
    "size", "dim", "ndimension", "numel", "nelement", "__len__", "__get__", "stride",
    "element_size", "is_floating_point", "is_complex", "is_contiguous", "get_device",
    "storage_offset", "data_ptr", "__format__", "__repr__",
}  # fmt: skip


def _any_meta(x: Any) -> bool:
    return any(t.is_meta for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))


def _mixes_meta(x: Any) -> bool:
    devices = {t.is_meta for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)}
    return len(devices) == 2


def _real_device(x: Any) -> Any:
    return torch.device("cpu") if isinstance(x, torch.device) and x.type == "meta" else x


def _to_meta(x: Any) -> Any:
    return x.to("meta") if isinstance(x, torch.Tensor) and not x.is_meta else x


def _tensors_only(x: Any) -> bool:
    leaves = tree_flatten(x)[0]
    return all(isinstance(t, torch.Tensor) or t is None for t in leaves)


# Functions that draw from a random generator (by name: the torch function mode sees the name).
_RANDOM = {
    "bernoulli", "bernoulli_", "multinomial", "normal", "normal_", "poisson", "uniform_",
    "exponential_", "geometric_", "cauchy_", "log_normal_", "random_", "dropout", "dropout_",
    "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d",
}  # fmt: skip


def _draws(what: str) -> bool:
    return what.startswith("rand") or what in _RANDOM


def _source_name(tag: Any) -> str:
    kind, name = tag
    if kind == "bare":
        return f"parameter '{name}'"
    if kind == "inner":
        return (
            f"a value computed inside block {name} and not returned by it (kept by a hook or an "
            "attribute, e.g. HF's MoE router logits under output_router_logits=True: set it "
            "False, or compute that loss from what the blocks return)"
        )
    if kind == "part":
        return f"block {name[0]}'s output"
    return f"block {name}'s output" if kind == "block" else f"the output of '{name}'"
