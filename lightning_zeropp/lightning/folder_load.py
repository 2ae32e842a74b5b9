"""`MyModule.load_from_checkpoint(folder)` of a sharded checkpoint folder, in one process.

Lightning reads the checkpoint given to `load_from_checkpoint` with `pl_load` (an fsspec
`open`, then `torch.load`), which fails on a folder with `IsADirectoryError`; for its own FSDP
folders it leaves the user to run `consolidate_checkpoint` first. `install()` (run when the
Lightning front is imported) wraps the name `lightning.pytorch.core.saving.pl_load`, the one
`load_from_checkpoint` calls, so that a folder holding a ZeroPP checkpoint (`meta.pt`) is read
through the library instead: its checksums and `.metadata` checked (`core.weights`), the
tensors gathered into one file by torch's own `dcp_to_torch_save` and read as data, `meta.pt`
read as data, and the keys renamed as Lightning's `consolidate_checkpoint` renames them.
Everything else (files, URLs, other folders) goes to Lightning's loader unchanged.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

from lightning.pytorch.core import saving
from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_zeropp.core.weights import checkpoint as ckpt
from lightning_zeropp.core.weights import checksum, trust

__all__ = ["install", "read_folder"]


def read_folder(path: Path) -> dict[str, Any]:
    """A ZeroPP sharded checkpoint folder as the one checkpoint dict `consolidate_checkpoint`
    would write (`state_dict`, `optimizer_states`, Lightning's other keys), on the CPU; a
    changed or code-naming file is refused naming it (`ValueError`)."""
    problem = checksum.verify(path, 0, 1)
    if problem is not None:
        raise ValueError(problem)
    trust.check_metadata(path)
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "consolidated.pt"
        dcp_to_torch_save(path, whole)
        checkpoint = trust.read_data(whole)
    checkpoint.update(trust.load_meta(path / ckpt.META_FILE))
    return _format_checkpoint(checkpoint)


def install() -> None:
    """Route `load_from_checkpoint` of a ZeroPP checkpoint folder to `read_folder` (once)."""
    lightning_load = saving.pl_load
    if getattr(lightning_load, "_zeropp", False):
        return

    @functools.wraps(lightning_load)
    def pl_load(path_or_url: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(path_or_url, (str, Path)) and ckpt.is_checkpoint(Path(path_or_url)):
            return read_folder(Path(path_or_url))
        return lightning_load(path_or_url, *args, **kwargs)

    pl_load._zeropp = True  # type: ignore[attr-defined]
    saving.pl_load = pl_load
