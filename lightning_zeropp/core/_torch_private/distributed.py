"""c10d's internals: the default store, a group's timeout, backend options that create a
mesh's groups with a timeout, and a mesh's dimensions flattened into one (`core.mesh`,
`core.step.failure`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["default_store", "flatten_mesh", "group_timeout", "mesh_group_options"]


def default_store() -> Any:
    """The c10d store the default process group rendezvoused on (shared by every rank)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def group_timeout(group: Any) -> timedelta | None:
    """The timeout `group`'s operations run under, as its first backend that tells reports it."""
    for device in group._device_types:
        try:
            timeout = getattr(group._get_backend(device).options, "_timeout", None)
        except (RuntimeError, AttributeError):  # no backend for this device, or no options
            continue
        if timeout is not None:
            return timeout
    return None


def mesh_group_options(device_type: str, timeout: timedelta) -> Any | None:
    """Backend options that make `init_device_mesh(backend_override=...)` create a dimension's
    groups with `timeout` (None for device types other than "cpu" and "cuda": torch's default).

    A group's timeout must be given when it is created: gloo's point-to-point receives wait on
    the connection context's timeout, which a later `ProcessGroup.set_timeout` does not change.
    NCCL groups need NCCL's own options class; gloo ignores the object beyond its timeout.
    """
    if device_type == "cuda" and dist.is_nccl_available():
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False  # torch's default for groups it creates
        options._timeout = timeout
        return options
    if device_type == "cpu":
        # Ignored below: the stubs declare Options() without the (backend, timeout) it takes
        return dist.ProcessGroupGloo.Options("gloo", timeout)  # type: ignore[call-arg]
    return None


def flatten_mesh(mesh: Any, name: str, options: Any | None = None) -> Any:
    """`mesh` (a slice of a root mesh) as one dimension called `name`, registered on the root so
    that `root[name]` and `root[other, name]` find it: torchtitan's way of sharding over
    dp_shard x cp (`DeviceMesh._flatten`, private in torch); `options` as `mesh_group_options`."""
    return mesh._flatten(name, backend_override=options)
