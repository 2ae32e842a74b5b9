"""Atomic commit of checkpoint directories and files: under its name there is always a complete one.

A directory cannot replace another in one step (`rename(2)` refuses a non-empty target), so a
checkpoint directory that may be written again under the same name (Lightning's `last.ckpt`,
`accelerator.save_state("ckpt")`) is published through a symbolic link:

1. the writer fills a hidden temporary sibling, `.NAME.tmp-ID` (`temporary(path)`);
2. when every rank has finished, `publish` renames it `.NAME.v-ID` (the name says "complete"),
3. points a fresh link at it and renames the link over `NAME` (atomic: `NAME` always resolves to
   the previous or the new version), then removes every other `.NAME.*` sibling: the replaced
   version and what crashed saves left behind.

Readers follow the link like any path (DCP, `torch.load`, Lightning's `ckpt_path="last"` glob,
which matches `last.ckpt` and not the hidden versions). `remove(path)` deletes the link and its
version. A file is replaced by `os.replace`, atomic by itself.

A real directory under `NAME` (written before links were used, or by hand) has to be moved aside
once before the link can take its place; a crash in that one window leaves `NAME` missing with a
complete `.NAME.v-*` beside it, which `recover(path)` (called before every load) links back.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

__all__ = ["publish", "recover", "remove", "temporary"]

# `.NAME.KIND-TOKEN`: a temporary, a complete version, a directory moved aside, a link in the
# making. Nothing else is ever touched (`last.ckpt.bak` or `.last.ckpt.mine` are not ours).
_SIBLING = re.compile(r"\.(?P<kind>tmp|v|old|link)-[0-9a-f]{8}")


def temporary(path: str | Path) -> Path:
    """A fresh hidden sibling of `path` to write the new checkpoint into (not created)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{_token()}")


def publish(tmp: Path, path: str | Path, *, link: bool = True) -> Path:
    """Make the complete `tmp` (from `temporary(path)`) the content of `path`, atomically.

    `link=False` for a directory that must stay a real directory (an export others copy, a name
    a tool lists and deletes itself): renamed into place when `path` is new, which is atomic;
    an existing `path` is moved aside first, the one window `recover` covers.
    """
    path = Path(path)
    if not tmp.is_dir():
        os.replace(tmp, path)  # a file (or a link to a directory) is replaced in one step
        _clean_siblings(path, keep=None)
        return path
    version = path.with_name(f".{path.name}.v-{_token()}")
    tmp.rename(version)  # complete from now on: a crash after this recovers it
    if path.is_dir() and not path.is_symlink():
        # A real directory cannot be replaced in one step; `recover` covers this window.
        path.rename(path.with_name(f".{path.name}.old-{_token()}"))
    if link:
        pointer = path.with_name(f".{path.name}.link-{_token()}")
        pointer.symlink_to(version.name)  # relative: the checkpoint's folder can move
        os.replace(pointer, path)
        _clean_siblings(path, keep=version.name)
    else:
        version.rename(path)
        _clean_siblings(path, keep=None)
    return path


def recover(path: str | Path) -> bool:
    """If `path` is missing or a dangling link and a complete version sits beside it, link the
    newest back under `path`. Returns whether it did. Leaves everything else alone."""
    path = Path(path)
    if path.exists():
        return False
    versions = [
        p
        for p in _siblings(path)
        if _kind(path, p) in ("v", "old") and p.is_dir() and not p.is_symlink()
    ]
    if not versions:
        return False
    newest = max(versions, key=lambda p: p.stat().st_mtime)
    pointer = path.with_name(f".{path.name}.link-{_token()}")
    pointer.symlink_to(newest.name)
    os.replace(pointer, path)
    _clean_siblings(path, keep=newest.name)
    return True


def remove(path: str | Path) -> None:
    """Delete the checkpoint at `path`: a link and the version it points to, a directory or a file."""
    path = Path(path)
    if path.is_symlink():
        target = path.resolve()
        path.unlink()
        if target.is_dir() and target.parent == path.parent.resolve():
            shutil.rmtree(target, ignore_errors=True)
    elif path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    _clean_siblings(path, keep=None)


def _token() -> str:
    return uuid.uuid4().hex[:8]


def _kind(path: Path, sibling: Path) -> str | None:
    """'tmp', 'v', 'old' or 'link' for an entry this module made for `path`, else None."""
    prefix = f".{path.name}"
    if not sibling.name.startswith(prefix):
        return None
    match = _SIBLING.fullmatch(sibling.name[len(prefix) :])
    return match["kind"] if match else None


def _siblings(path: Path) -> list[Path]:
    """The hidden `.NAME.KIND-TOKEN` entries this module makes for `path`."""
    if not path.parent.is_dir():
        return []
    return [p for p in path.parent.iterdir() if _kind(path, p)]


def _clean_siblings(path: Path, keep: str | None) -> None:
    """Remove replaced versions, stale temporaries and links of `path`, except `keep`."""
    for p in _siblings(path):
        if p.name == keep:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
