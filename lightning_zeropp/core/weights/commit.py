"""Atomic commit of checkpoint directories and files: under its name there is always a complete one.

1. The writer fills a hidden temporary sibling, `.NAME.tmp-ID` (`temporary(path)`).
2. When every rank has finished, `publish` puts it under `NAME` in one step: a rename when `NAME`
   is new, else an atomic exchange of the two directories (Linux's `renameat2(RENAME_EXCHANGE)`),
   after which the replaced checkpoint sits at the temporary's name and is deleted. `NAME` is a
   plain directory at every moment: the previous checkpoint or the new one, and `cp -r NAME`
   copies a checkpoint (no link to follow).

A filesystem without the exchange (some network filesystems) publishes through a symbolic link
instead: the temporary is renamed `.NAME.v-ID` (complete), a fresh link to it is renamed over
`NAME` (atomic). Copy such a checkpoint with `cp -rL`. Replacing a real directory by a link
first moves it aside (`.NAME.old-ID`); a kill in that window leaves `NAME` missing with complete
versions beside it, which `recover(path)` (called before every load) puts back.

Nothing complete is deleted but the checkpoint a publish replaces: a complete `.NAME.v-*` or
`.NAME.old-*` that a crash left is kept, and `recover` (before every load) puts the newest
complete one under `NAME`, whatever point of the sequence the kill interrupted. Temporaries and links of a
crashed save are removed by the next save of that name, and `clean_temporaries(folder)` removes
every one in a folder (a run's first save does). A file is replaced by `os.replace`, atomic by
itself.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path

__all__ = ["clean_temporaries", "is_temporary", "publish", "recover", "remove", "temporary"]

# `.NAME.KIND-TOKEN`: a temporary, a complete version, a directory moved aside, a link in the
# making. Nothing else is ever touched (`last.ckpt.bak` or `.last.ckpt.mine` are not ours).
_SIBLING = re.compile(r"\.(?P<kind>tmp|v|old|link)-[0-9a-f]{8}")
_ANY_TEMPORARY = re.compile(r"\..+\.(tmp|link)-[0-9a-f]{8}")
_EXCHANGE: dict[str | int, bool] = {"supported": True}  # off after a filesystem refused it once


def temporary(path: str | Path) -> Path:
    """A fresh hidden sibling of `path` to write the new checkpoint into (not created)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{_token()}")


def is_temporary(path: str | Path) -> bool:
    """Whether `path` names a temporary (or a link in the making) of a save, not a checkpoint."""
    return _ANY_TEMPORARY.fullmatch(Path(path).name) is not None


def publish(tmp: Path, path: str | Path, *, link: bool = True) -> Path:
    """Make the complete `tmp` (from `temporary(path)`) the content of `path`, atomically.

    `link=False` for a directory that must stay a real directory even where the filesystem
    cannot exchange two directories (an export others copy): there an existing `path` is moved
    aside first, the one window `recover` covers.
    """
    path = Path(path)
    if not tmp.is_dir():
        os.replace(tmp, path)  # a file (or a link to a directory) is replaced in one step
        _clean_siblings(path)
        return path
    if not path.exists() and not path.is_symlink() and _can_exchange(path.parent):
        tmp.rename(path)  # a new name: one rename
        _clean_siblings(path)
        return path
    if path.exists() and _exchange(tmp, path):  # `tmp` now holds what `path` held
        _discard(tmp)
        _clean_siblings(path)
        return path
    return _publish_by_link(tmp, path, link)


def recover(path: str | Path) -> bool:
    """Put the newest complete version of `path` under its name, whatever point of a publish a
    kill interrupted: the name missing or a dangling link (a real directory moved aside), or
    the name holding an older checkpoint than a complete version beside it (killed after the
    version was complete, before the name moved to it). Returns whether it changed anything.
    Leaves everything else alone."""
    path = Path(path)
    versions = [
        p
        for p in _siblings(path)
        if _kind(path, p) in ("v", "old") and p.is_dir() and not p.is_symlink()
    ]
    if not versions:
        return False
    newest = max(versions, key=_completed_at)
    if path.exists():
        current = path.resolve()
        if current == newest.resolve() or _completed_at(current) >= _completed_at(newest):
            return False
        if path.is_symlink():  # killed before the link moved: move it now (one step)
            pointer = path.with_name(f".{path.name}.link-{_token()}")
            pointer.symlink_to(newest.name)
            os.replace(pointer, path)
            if current.parent == path.parent.resolve():  # replaced, as publish would have
                _discard(current)
            _clean_siblings(path)
            return True
        path.rename(path.with_name(f".{path.name}.old-{_token()}"))  # kept: complete
    elif path.is_symlink():
        path.unlink()
    try:
        newest.rename(path)  # a plain directory again: nothing else links to it
    except OSError:  # another process recovered it first
        return path.exists()
    _clean_siblings(path)
    return True


def _completed_at(folder: Path) -> int:
    """When a checkpoint directory was completed: its checksum file is the last one a save
    writes (`core.weights.checksum`); else the directory's own modification time."""
    sums = folder / "SHA256SUMS"
    return (sums if sums.is_file() else folder).stat().st_mtime_ns


def remove(path: str | Path) -> None:
    """Delete the checkpoint at `path`: a directory (or a link and the version it points to) or a
    file, and whatever crashed saves of that name left beside it."""
    path = Path(path)
    _discard(path)
    for p in _siblings(path):
        _discard(p)


def clean_temporaries(folder: str | Path) -> list[str]:
    """Remove the temporaries and links crashed saves left in `folder` (any name); returns their
    names. Complete versions stay."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    stale = [p for p in folder.iterdir() if _ANY_TEMPORARY.fullmatch(p.name)]
    for p in stale:
        _discard(p, follow=False)
    return [p.name for p in stale]


def _publish_by_link(tmp: Path, path: Path, link: bool) -> Path:
    """Where directories cannot be exchanged: a link renamed over `path` (see the module)."""
    replaced = path.resolve() if path.is_symlink() else None
    version = path.with_name(f".{path.name}.v-{_token()}")
    tmp.rename(version)  # complete from now on: a crash after this recovers it
    if path.is_dir() and not path.is_symlink():
        # A real directory cannot be replaced by a link in one step; `recover` covers this.
        aside = path.with_name(f".{path.name}.old-{_token()}")
        path.rename(aside)
        replaced = aside
    if link:
        pointer = path.with_name(f".{path.name}.link-{_token()}")
        pointer.symlink_to(version.name)  # relative: the checkpoint's folder can move
        os.replace(pointer, path)
    else:
        if path.is_symlink():
            path.unlink()
        version.rename(path)
    if replaced is not None and replaced.parent == path.parent.resolve():
        _discard(replaced)
    _clean_siblings(path)
    return path


def _can_exchange(folder: Path) -> bool:
    """Whether `folder`'s filesystem can exchange two directories (tried once per filesystem on
    two empty ones): a name first published there as a plain directory must be replaceable
    in one step later."""
    device = folder.stat().st_dev
    if device not in _EXCHANGE:
        a, b = (folder / f".lzpp-probe-{_token()}" for _ in range(2))
        a.mkdir()
        b.mkdir()
        try:
            _EXCHANGE[device] = _exchange(a, b)
        finally:
            a.rmdir()
            b.rmdir()
    return bool(_EXCHANGE[device]) and _EXCHANGE["supported"]


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step; False where the filesystem (or the system) cannot."""
    if not _EXCHANGE["supported"]:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        _EXCHANGE["supported"] = False
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        _EXCHANGE["supported"] = False
        return False
    raise OSError(code, f"exchanging {a} and {b}: {os.strerror(code)}")


def _discard(path: Path, follow: bool = True) -> None:
    """Delete a directory, a file, or a link and (with `follow`) the sibling version it names."""
    if path.is_symlink():
        target = path.resolve()
        path.unlink()
        if follow and target.is_dir() and target.parent == path.parent.resolve():
            shutil.rmtree(target, ignore_errors=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink(missing_ok=True)


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


def _clean_siblings(path: Path) -> None:
    """Remove stale temporaries and links of `path` (a crashed save's); keep complete versions
    that a crash left, warning once per publish."""
    kept = []
    target = path.resolve().name if path.is_symlink() else None
    for p in _siblings(path):
        if _kind(path, p) in ("tmp", "link"):
            _discard(p, follow=False)
        elif p.name != target and p.is_dir():
            kept.append(p.name)
    if kept:
        warnings.warn(
            f"kept {', '.join(sorted(kept))} beside {path}: complete checkpoints a crashed save "
            "left there. Delete them, or rename one to use it.",
            stacklevel=3,
        )
