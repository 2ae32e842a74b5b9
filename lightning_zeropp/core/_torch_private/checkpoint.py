"""Distributed checkpoint (DCP) internals: what its metadata pickle may name, and the files a
rank's write plan and results name (`core.weights`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["dcp_write_prefix", "dcp_written_files", "is_dcp_metadata_global"]


def is_dcp_metadata_global(module: str, name: str) -> bool:
    """Whether a distributed checkpoint's `.metadata` pickle may name `module.name`: DCP's own
    metadata classes (some private: `filesystem._StorageInfo`), torch's dtypes, `torch.Size`
    and layouts, and the path DCP records; nothing that runs code of the pickle's choosing."""
    import torch

    if module == "torch.distributed.checkpoint.metadata":
        return True
    if (module, name) in {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint.planner", "LoadItemType"),
        ("torch.distributed.checkpoint.planner", "WriteItemType"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }:
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def dcp_write_prefix(plan: Any) -> str:
    """The file-name prefix DCP's filesystem writer gives one rank's files (`__3_`), from the
    rank's save plan (its `storage_data`, a private `_StoragePrefix`)."""
    return plan.storage_data.prefix


def dcp_written_files(results: Any) -> list[str]:
    """The files one rank's DCP write results name (their private `_StorageInfo`)."""
    return sorted({str(r.storage_data.relative_path) for r in results})
