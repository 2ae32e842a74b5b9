"""torch's pytree utilities (`torch.utils._pytree`, which has no public twin in torch 2.13):
flattening nested containers of tensors the way torch's own pipelining and export do, so the
library's flat views of a batch or a module's call line up with theirs (`core.split`,
`core.step.batch`, `core.weights`, the Lightning front).
"""

from __future__ import annotations

from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten

__all__ = ["TreeSpec", "tree_flatten", "tree_map", "tree_unflatten"]
