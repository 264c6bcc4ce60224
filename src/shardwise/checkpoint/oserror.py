"""A failed write of a checkpoint, said in words: which directory, what the OS said, what to do."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any, Callable, TypeVar

from .errors import CheckpointError

__all__ = ["explained", "os_error"]

_T = TypeVar("_T")

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
    """Run ``fn``; an OS error becomes a :class:`CheckpointError` naming the directory and what to do."""
    try:
        return fn()
    except OSError as exc:
        raise os_error(temp, exc) from exc


def os_error(temp: Path, exc: OSError) -> CheckpointError:
    cause = _CAUSES.get(exc.errno or 0, "see the error above")
    return CheckpointError(
        f"cannot write the checkpoint in {temp.parent} ({exc.strerror or exc}: {exc.filename or temp}); {cause}. "
        f"Nothing was committed: the previous checkpoint and `latest` are unchanged"
    )
