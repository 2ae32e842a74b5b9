"""Per-file checksums of a checkpoint: written at save, checked at load, naming the file.

A shard changed after the save (a flipped bit on disk, a truncated copy, an edit) would load
without a word and train from wrong values. Each rank hashes (SHA-256) the shard files it wrote,
right after writing them, inside DCP's write step (`ChecksumWriter`), into a hidden part file;
when every rank has written, global rank 0 merges the parts with the hashes of `.metadata` and
`meta.pt` into one `SHA256SUMS` (the format of coreutils' `sha256sum`: `sha256sum -c SHA256SUMS`
checks a copy by hand) before it publishes the checkpoint.

A front's folder around it (the Trainer's scheduler, RNG and state files, Accelerate's registered
objects and RNG states) gets a `SHA256SUMS` of its own top-level files (`write_folder_sums`), checked
by every rank (`verify(folder, 0, 1)`) before any of them is read.

At load every rank checks `.metadata` and `meta.pt` (every rank reads them) and a share of the
shard files (rank r the files r, r + world, ...): the checkpoint is read once in all. A checkpoint
without `SHA256SUMS` (written before checksums) loads unchecked.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

from lightning_zeropp.core._torch_private import dcp_write_prefix, dcp_written_files

__all__ = ["SUMS_FILE", "ChecksumWriter", "verify", "write_folder_sums", "write_sums"]

SUMS_FILE = "SHA256SUMS"
_PART = ".sha256"  # + a rank's DCP prefix: that rank's files' hashes, merged at publish
_ALWAYS = (".metadata", "meta.pt")  # read by every rank at load


class ChecksumWriter(FileSystemWriter):
    """DCP's filesystem writer that also hashes the files this rank writes (see the module)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        results = future.wait()  # the filesystem writer writes before it returns
        files = dcp_written_files(results)
        prefix = dcp_write_prefix(plan)
        lines = "".join(f"{_digest(Path(self.path) / f)}  {f}\n" for f in files)
        (Path(self.path) / f"{_PART}{prefix}").write_text(lines)
        return future


def write_sums(directory: Path) -> None:
    """On one rank, after every rank has written: merge the parts and hash the files every rank
    reads into `SHA256SUMS`."""
    lines = []
    for part in sorted(directory.glob(f"{_PART}*")):
        lines.append(part.read_text())
        part.unlink()
    for name in _ALWAYS:
        if (directory / name).is_file():
            lines.append(f"{_digest(directory / name)}  {name}\n")
    (directory / SUMS_FILE).write_text("".join(lines))


def write_folder_sums(directory: Path) -> None:
    """On one rank, once every rank has written: hash the files directly in `directory` (its
    subfolders have their own sums) into `SHA256SUMS`."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != SUMS_FILE)
    (directory / SUMS_FILE).write_text("".join(f"{_digest(p)}  {p.name}\n" for p in files))


def verify(directory: Path, rank: int, world: int, shards: bool = True) -> str | None:
    """The first problem with this rank's share of `directory`'s files, in one line, or None
    (`shards=False`: only the files every rank reads, `.metadata` and `meta.pt`)."""
    sums = directory / SUMS_FILE
    if not sums.is_file():
        return None
    listed: list[tuple[str, str]] = []
    for line in sums.read_text().splitlines():
        digest, _, name = line.partition("  ")
        if not name or len(digest) != 64:
            return f"{sums} is damaged (line {line[:80]!r}): the checkpoint cannot be trusted"
        listed.append((name, digest))
    others = [item for item in listed if item[0] not in _ALWAYS]
    mine = [item for item in listed if item[0] in _ALWAYS] + (others[rank::world] if shards else [])
    for name, digest in mine:
        file = directory / name
        if not file.is_file():
            return f"{file} is missing (listed in {SUMS_FILE}): the checkpoint is incomplete"
        if _digest(file) != digest:
            return (
                f"{file} does not match its checksum in {sums}: it changed after the save "
                "(damaged on disk, or edited). Use another checkpoint (an earlier save, or a "
                "copy of this one)."
            )
    return None


def _digest(file: Path) -> str:
    with open(file, "rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()
