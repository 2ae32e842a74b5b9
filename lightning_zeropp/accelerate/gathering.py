"""`GatheringAccelerator`: `ZeroPPAccelerator`'s `gather` and `gather_for_metrics`, which
concatenate every process's share of its pipeline's batch in DDP's process order
(`accelerate.shares`): every sample once, from the process DDP would have loaded it on. All
stages of a pipeline read the same batch, so Accelerate's own gather would repeat each row once
per process of a pipeline. Before a model is prepared (no pipeline yet) Accelerate's own run.

`ZeroPPAccelerator` derives from it, and it from `Accelerator`: the method order is as it was.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import recursively_apply

from lightning_zeropp.accelerate.prepared import length
from lightning_zeropp.accelerate.shares import in_process_order, owners_only, share, share_of
from lightning_zeropp.accelerate.steps import PipelineModel

__all__ = ["GatheringAccelerator"]


class GatheringAccelerator(Accelerator):
    """`Accelerator` whose gathers give each sample of the pipelines' batches once, in DDP's
    process order (the attributes below are `ZeroPPAccelerator`'s)."""

    pipeline: PipelineModel | None
    _order: list[int]  # global ranks in DDP's process order (`shares`)

    def gather(self, tensor: Any) -> Any:
        """Concatenate every process's share in DDP's process order (`shares`): each sample
        of the pipelines' batches once, from the process DDP would have loaded it on."""
        if self.pipeline is None:
            return super().gather(tensor)
        full = super().gather(recursively_apply(self._share, tensor))
        world, rows = self.num_processes, self.pipeline.given_rows
        pp = share_of(self.pipeline.engine.dims)[0]  # processes per data-parallel rank

        def arranged(t: torch.Tensor) -> torch.Tensor:
            ordered = in_process_order(t, world, self._order)
            # rows that do not split into shares (a packed row) came from every process of a
            # pipeline: each once, from the pipeline's first process
            whole_rows = rows is not None and rows % pp and t.dim() and t.shape[0] == world * rows
            return owners_only(ordered, world, pp) if whole_rows else ordered

        return recursively_apply(arranged, full)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        if self.pipeline is None:
            return super().gather_for_metrics(input_data, use_gather_object)
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
            tensors = True
        except TypeError:
            tensors = False
        if tensors and not use_gather_object:
            return super().gather_for_metrics(input_data)  # through gather, then truncated
        everyone: list[Any] = [None] * self.num_processes
        dist.all_gather_object(everyone, self._share(input_data))
        rows, pp = self.pipeline.given_rows, share_of(self.pipeline.engine.dims)[0]
        whole_rows = rows is not None and rows % pp and length(input_data) == rows
        order = self._order[::pp] if whole_rows else self._order  # each pipeline's rows once
        data = [x for r in order for x in everyone[r]]
        state = self.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            data = data[: state.remainder]
        return data

    def _share(self, value: Any) -> Any:
        assert self.pipeline is not None
        dims = self.pipeline.engine.dims
        return share(value, self.pipeline.given_rows, *share_of(dims))
