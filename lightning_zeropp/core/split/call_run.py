"""The dry run of `split="call"`: the model's forward run once, every block call recorded.

`dry_run` runs the forward (on a meta-device copy, or the real model) with hooks on the blocks and
on the outer modules (embeddings, norms, heads), and records a `BlockCall` per block call, the
order blocks and outer modules ran in, and, through `Tagger`, where every value came from.
`call_plan` reads that record to decide whether the model pipelines exactly and how.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_zeropp.core._torch_private import tree_flatten, tree_map
from lightning_zeropp.core.split.blocks import BlockPlan
from lightning_zeropp.core.split.tags import Tagger

__all__ = ["FIX", "BlockCall", "DryRun", "DryRunFailed", "dry_run", "outer_parts"]

FIX = "use split='trace' (with an example micro-batch) or a split callable"


def outer_parts(model: nn.Module, container: str) -> tuple[list[str], list[str]]:
    """Beside the path to the block container: the modules with parameters (embeddings, norms,
    heads) and the parameters held directly by the model or a module on that path."""
    units, bare, parent, prefix = [], [], model, ""
    for part in container.split(".") if container else []:
        for name, child in parent.named_children():
            if name != part and any(True for _ in child.parameters()):
                units.append(prefix + name)
        bare += [prefix + name for name, p in parent._parameters.items() if p is not None]
        parent, prefix = parent.get_submodule(part), f"{prefix}{part}."
    return units, bare


class DryRunFailed(Exception):
    """The model's forward raised during the dry run."""


@dataclass
class BlockCall:
    """One block call seen by the dry run: which block, what it was called with, where each
    tensor leaf of its `(args, kwargs)` came from (`Tagger.of`), and what it returned."""

    block: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    sources: list[Any]
    out: Any = None


class DryRun:
    """The model's forward run once with hooks on its blocks and outer modules: the block
    calls in order (`calls`), the order blocks and outer modules ran in (`events`), and where
    every value came from (`tagger`)."""

    def __init__(self, skeleton: nn.Module, blocks: BlockPlan, mixed: bool) -> None:
        self.skeleton = skeleton
        container = skeleton.get_submodule(blocks.container) if blocks.container else skeleton
        self.blocks = [container.get_submodule(n) for n in blocks.names]
        self.units, self.bare = outer_parts(skeleton, blocks.container)
        self.tagger = Tagger(mixed)
        self.calls: list[BlockCall] = []
        self.events: list[tuple[str, Any]] = []
        self.handles: list[Any] = []

    def block_pre(self, i: int) -> Callable[..., Any]:
        tagger = self.tagger

        def hook(module: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
            sources = [tagger.of(t) for t in tree_flatten((a, kw))[0]]
            self.calls.append(BlockCall(i, a, kw, sources))
            self.events.append(("block", i))
            tagger.after, tagger.started = None, True
            clean = tree_map(lambda t: t.view_as(t) if isinstance(t, torch.Tensor) else t, (a, kw))
            for t in tree_flatten(clean)[0]:
                tagger.tags.pop(id(t), None)
            tagger.inside = i
            return clean

        return hook

    def block_post(self, i: int) -> Callable[..., Any]:
        tagger, last = self.tagger, len(self.blocks) - 1

        def hook(module: nn.Module, a: Any, kw: Any, out: Any) -> None:
            self.calls[-1].out = out
            tagger.inside = None
            if isinstance(out, (tuple, list)) and len(out) > 1:
                # Each part on its own: the next block takes one, the others may be extras
                # read after the blocks (decided by `_plan` once the chain is known).
                for j, part in enumerate(out):
                    tagger.tag(part, frozenset({("part", (i, j))}))
            else:
                tagger.tag(out, frozenset({("block", i)}))
            tagger.after = i if i == last else None

        return hook

    def unit_pre(self, name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, a: Any) -> None:
            self.tagger.units.append(name)

        return hook

    def unit_post(self, name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, a: Any, out: Any) -> None:
            self.tagger.units.remove(name)
            self.events.append(("unit", name))
            if self.tagger.after is None and not any(e[0] == "block" for e in self.events):
                self.tagger.tag(out, frozenset({("unit", name)}))

        return hook

    def install(self) -> None:
        """Hooks on every block and outer module; the outer modules' parameters tagged."""
        skeleton, tagger, handles = self.skeleton, self.tagger, self.handles
        for i, b in enumerate(self.blocks):
            handles.append(b.register_forward_pre_hook(self.block_pre(i), with_kwargs=True))
            handles.append(b.register_forward_hook(self.block_post(i), with_kwargs=True))
        # A tied weight belongs to every unit using it (an HF tied head: the embedding and
        # lm_head), each of which gets its own copy on its own stage (see core.tied).
        owners: dict[int, tuple[str, ...]] = {}
        for name in self.units:
            for p in skeleton.get_submodule(name).parameters():
                owners[id(p)] = (*owners.get(id(p), ()), name)
        for name in self.units:
            unit = skeleton.get_submodule(name)
            handles.append(unit.register_forward_pre_hook(self.unit_pre(name)))
            handles.append(unit.register_forward_hook(self.unit_post(name)))
            for p in unit.parameters():
                tagger.tag(p, frozenset({("param", owners[id(p)])}))
        for name in self.bare:  # read where the model's own code reads them (`Tagger.bare`)
            tagger.add_bare(skeleton.get_parameter(name), name)


def dry_run(
    skeleton: nn.Module,
    blocks: BlockPlan,
    example: tuple[tuple[Any, ...], dict[str, Any]],
    model: nn.Module,
    mixed: bool = False,
) -> DryRun:
    """`model`'s forward run on `skeleton` (a copy, or the model itself) with one example
    micro-batch, recorded; `DryRunFailed` when the forward raises."""
    args, kwargs = example
    run = DryRun(skeleton, blocks, mixed)
    tagger, last = run.tagger, len(run.blocks) - 1
    run.install()
    try:
        with tagger:
            out = skeleton(*args, **kwargs)
            tagger.inside, tagger.after = None, last
            final = tagger.of(out)
    except Exception as err:
        device = "meta" if any(p.is_meta for p in skeleton.parameters()) else "real"
        raise DryRunFailed(
            f"could not check how {type(model).__name__} calls its blocks (a dry run on the "
            f"{device} model failed: {type(err).__name__}: {err}); {FIX}."
        ) from err
    finally:
        for h in run.handles:
            h.remove()
    if tagger.leak is None and not {t for t in final if t[0] != "part"} <= {("block", last)}:
        tagger.leak = "the model's output depends on values other than its last block's output"
    tagger.read_after |= {t for t in final if t[0] == "part"}
    return run
