"""`ZeroPPLayout`: a resolved `ZeroPPConfig`, what a run runs with, frozen and fully typed.

`core.settings.resolve` makes one from a config and a world; below a front's door only a layout
passes, so the engine, the planner and the fronts read sizes and policies without checking for
None. `check_layout` is the engine's check of what it is given: a layout for this world, never a
config that was not resolved.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from lightning_zeropp.core.settings.ranks import offload_ranks, stage_rank
from lightning_zeropp.core.settings.values import GradReduce, setting_error

__all__ = ["ZeroPPLayout", "check_layout"]


@dataclass(frozen=True, kw_only=True)
class ZeroPPLayout:
    """A resolved `ZeroPPConfig`: the same fields, every one decided (see `ZeroPPConfig` for
    what each means). `num_chunks` is v, `unit_size` U (None off `schedule="zeropp"`),
    `activation_checkpointing` one of "none", "all", "except_last"."""

    world_size: int
    pp_size: int
    dp_shard_size: int
    dp_replicate_size: int
    cp_size: int
    num_microbatches: int
    schedule: str
    num_chunks: int
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    activation_checkpointing: str
    recompute_ranks: list[int] | None
    offload_activations: str | list[int]
    reshard_after_forward: bool
    split_points: list[int] | None
    unit_size: int | None
    split_backward: bool
    grad_reduce: GradReduce
    nonfinite: str
    quantized_weights: str | None
    hpz_partition_size: int | None
    quantized_gradients: str | None
    gradient_error_feedback: bool
    quant_block_size: int
    cpu_offload: bool
    node_size: int
    compile: bool
    save_on_sigterm: bool
    loss_chunk: int | None

    @property
    def num_stages(self) -> int:
        """Pipeline stages in total: pp_size x num_chunks."""
        return self.pp_size * self.num_chunks

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: replicas x shards."""
        return self.dp_replicate_size * self.dp_shard_size

    def recomputes(self, stage: int) -> bool:
        """Whether stage `stage` recomputes its blocks' activations in backward."""
        policy = self.activation_checkpointing
        ranks = self.recompute_ranks
        if ranks is not None and stage_rank(self.schedule, stage, self.pp_size) not in ranks:
            return False
        return policy == "all" or (policy == "except_last" and stage != self.num_stages - 1)

    def offloads(self, stage: int) -> bool:
        """Whether stage `stage` keeps its saved activations in host memory until backward."""
        return stage_rank(self.schedule, stage, self.pp_size) in self.offload_ranks()

    def offload_ranks(self) -> list[int]:
        """The pipeline ranks that offload their activations (`core.settings.ranks`)."""
        return offload_ranks(
            self.offload_activations,
            self.schedule,
            self.pp_size,
            self.num_chunks,
            self.num_microbatches,
        )

    def resolve(self, world_size: int, node_size: int | None = None) -> ZeroPPLayout:
        """Already resolved: itself, for the world it was resolved for (`node_size` was
        decided when it was resolved)."""
        if world_size != self.world_size:
            raise setting_error(
                ("pp_size", "dp_replicate_size", "dp_shard_size", "cp_size"),
                f"this layout was resolved for {self.world_size} processes "
                f"(pp_size={self.pp_size} x dp_replicate_size={self.dp_replicate_size} x "
                f"dp_shard_size={self.dp_shard_size}"
                + (f" x cp_size={self.cp_size}" if self.cp_size > 1 else "")
                + f"), but the world has {world_size}; resolve the ZeroPPConfig for this world.",
            )
        return self

    def settings(self) -> dict[str, Any]:
        """The layout's settings as `ZeroPPConfig` keyword arguments (no `world_size`)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.pop("world_size")
        return values


def check_layout(layout: object, world_size: int) -> ZeroPPLayout:
    """`layout` if it is a `ZeroPPLayout` resolved for `world_size` processes; a config that was
    not resolved is refused, naming the call that resolves it (the core resolves nothing: the
    world and the launcher's ranks per node are known at a front's door)."""
    if not isinstance(layout, ZeroPPLayout):
        raise TypeError(
            f"ZeroPPEngine takes a resolved ZeroPPLayout, got {type(layout).__name__}: resolve the "
            "config for the launched world first, `ZeroPPEngine(model, "
            "lightning_zeropp.launch_layout(config), ...)` (reads the world size and the "
            "launcher's LOCAL_WORLD_SIZE), or `config.resolve(world_size, node_size)`."
        )
    return layout.resolve(world_size)
