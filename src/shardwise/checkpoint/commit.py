"""Writing a checkpoint: atomic files, the atomic commit, and a failed write said in words.

The steps and what a crash between them leaves are in ``docs/checkpoints.md`` ("Atomic commit"); rank 0 is the
only rank that renames.  :func:`write_atomic` creates a new file under a random name, exclusively and never through
a symlink, and renames it into place, so links planted in ``SAVE_DIR`` cannot redirect a write.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from .files import CheckpointError
from .layout import LATEST, TEMP_PREFIX

__all__ = ["commit", "explained", "fsync_dir", "need_space", "new_temp", "write_atomic", "write_json"]

_T = TypeVar("_T")
#: below this many free bytes, a write that failed for no stated reason is taken for a full disk
LOW_SPACE = 1 << 20
#: what a failed write most likely means, by errno
_CAUSES = {
    errno.ENOSPC: "the file system is full: free space there, or save to another `save_dir`",
    errno.EDQUOT: "the disk quota is used up: free space there, or save to another `save_dir`",
    errno.EACCES: "this process may not write there: fix the directory's permissions, or save elsewhere",
    errno.EPERM: "this process may not write there: fix the directory's permissions, or save elsewhere",
    errno.EROFS: "the file system is read-only: save to a writable `save_dir`",
    errno.ENOTDIR: "a part of the path is a file, not a directory: pick another `save_dir`",
}


def fsync_dir(path: Path) -> None:
    """Make ``path``'s entries (creations, renames) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not supported here (e.g. Windows): renames are as durable as the OS makes them
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new file next to ``path`` under a random name, created by this call (``O_EXCL``, ``O_NOFOLLOW``) with
    the mode ``open`` gives, not ``mkstemp``'s 0600: a checkpoint stays readable by the group."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.with_name(f"{TEMP_PREFIX}{path.name}.{secrets.token_hex(8)}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file next to {path}")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one, never a part (and a
    symlink at ``path`` is replaced, never written through)."""
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=1, allow_nan=False).encode())


def commit(temp: Path, final: Path) -> None:
    """Rename the finished ``temp`` directory to ``final`` and point ``latest`` at it."""
    fsync_dir(temp)
    old = None
    if os.path.lexists(final):  # a dangling symlink too: renaming over it would fail
        old = final.with_name(f"{temp.name}.replaced")
        os.rename(final, old)
    os.rename(temp, final)
    fsync_dir(final.parent)
    write_atomic(final.parent / LATEST, final.name.encode())
    if old is not None:
        _remove(old)


def _remove(path: Path) -> None:
    """Delete directory ``path``; a symlink is unlinked, never followed (its target is not ours)."""
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(OSError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def new_temp(temp: Path, tag: Optional[str]) -> None:
    """Create the new, empty directory ``temp`` (exclusively: its name is random); with ``tag``, it is a save's
    own, and what earlier, failed saves of ``tag`` left next to it is deleted first."""
    if tag is not None:
        temp.parent.mkdir(parents=True, exist_ok=True)
        pattern = re.compile(re.escape(f"{TEMP_PREFIX}{tag}-") + r"[0-9a-f]{12}(\.replaced)?")
        for child in temp.parent.glob(f"{TEMP_PREFIX}{tag}-*"):
            if pattern.fullmatch(child.name) and (child.is_symlink() or child.is_dir()):
                _remove(child)
    temp.mkdir()


def explained(temp: Path, fn: Callable[[], _T]) -> _T:
    """Run ``fn``; an OS error becomes a :class:`CheckpointError` naming the directory and what to do.  A
    ``RuntimeError`` (``torch.save``'s "unexpected pos" loses the OS error) on an almost full disk is a full disk."""
    try:
        return fn()
    except OSError as exc:
        raise _os_error(temp, exc) from exc
    except RuntimeError as exc:
        free = _free_bytes(temp)
        if free is None or free >= LOW_SPACE:
            raise
        raise _os_error(temp, OSError(errno.ENOSPC, f"No space left on device ({free:,} bytes free)", str(temp))) from exc


def _free_bytes(path: Path) -> Optional[int]:
    """Bytes free on the file system of ``path`` (or of its nearest existing parent); None if unknown."""
    for candidate in (path, *path.parents):
        try:
            return int(shutil.disk_usage(candidate).free)
        except OSError:
            continue
    return None


def need_space(path: Path, needed: int) -> None:
    """Raise ENOSPC before writing ``needed`` bytes into ``path`` when the file system has less free."""
    free = _free_bytes(path)
    if free is not None and free < needed:
        raise OSError(errno.ENOSPC, f"No space left on device: {needed:,} bytes to write, {free:,} free", str(path))


def _os_error(temp: Path, exc: OSError) -> CheckpointError:
    cause = _CAUSES.get(exc.errno or 0, "see the error above")
    return CheckpointError(
        f"cannot write the checkpoint in {temp.parent} ({exc.strerror or exc}: {exc.filename or temp}); {cause}. "
        f"Nothing was committed: the previous checkpoint and `latest` are unchanged"
    )
