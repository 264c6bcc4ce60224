"""A failed write of a checkpoint, said in words: which directory, what the OS said, what to do."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Callable, Optional, TypeVar

from .errors import CheckpointError

__all__ = ["explained", "free_bytes", "need_space", "os_error"]

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


def explained(temp: Path, fn: Callable[[], _T]) -> _T:
    """Run ``fn``; an OS error becomes a :class:`CheckpointError` naming the directory and what to do.

    ``torch.save`` reports a failed write as ``RuntimeError: unexpected pos`` (the OS error is lost on the
    way): such an error on a file system with almost no space left is taken for what it is, a full disk.
    """
    try:
        return fn()
    except OSError as exc:
        raise os_error(temp, exc) from exc
    except RuntimeError as exc:
        free = free_bytes(temp)
        if free is None or free >= LOW_SPACE:
            raise
        raise os_error(temp, OSError(errno.ENOSPC, f"No space left on device ({free:,} bytes free)", str(temp))) from exc


def free_bytes(path: Path) -> Optional[int]:
    """Bytes free on the file system of ``path`` (or of its nearest existing parent); None if unknown."""
    for candidate in (path, *path.parents):
        try:
            return int(shutil.disk_usage(candidate).free)
        except OSError:
            continue
    return None


def need_space(path: Path, needed: int) -> None:
    """Raise ENOSPC before writing ``needed`` bytes into ``path`` when the file system has less free."""
    free = free_bytes(path)
    if free is not None and free < needed:
        raise OSError(errno.ENOSPC, f"No space left on device: {needed:,} bytes to write, {free:,} free", str(path))


def os_error(temp: Path, exc: OSError) -> CheckpointError:
    cause = _CAUSES.get(exc.errno or 0, "see the error above")
    return CheckpointError(
        f"cannot write the checkpoint in {temp.parent} ({exc.strerror or exc}: {exc.filename or temp}); {cause}. "
        f"Nothing was committed: the previous checkpoint and `latest` are unchanged"
    )
