"""Reading a checkpoint's files as untrusted input: no links followed, nothing read past a limit.

A checkpoint directory may come from someone else.  Each of its small files
is opened with ``O_NOFOLLOW`` (a symlink planted in its place could point at
any file of the user) and ``O_NONBLOCK`` (a FIFO planted there would block
the open forever), must be a regular file, and is read only if it is no
larger than its limit (``limits.py``).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from .errors import CheckpointError

__all__ = ["is_real_dir", "open_regular", "read_json", "read_limited", "regular_size"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _not_regular(path: Path, mode: int) -> CheckpointError:
    kind = "a symbolic link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"
    return CheckpointError(
        f"{path} is {kind}; a checkpoint's files must be regular files inside its directory (links are never "
        "followed, so a checkpoint cannot make shardwise read another file): replace it with the real file"
    )


def open_regular(path: Path) -> BinaryIO:
    """Regular file ``path`` opened for reading, never through a link (nor a FIFO, which would block).

    Raises FileNotFoundError if it does not exist, :class:`CheckpointError` otherwise.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _not_regular(path, stat.S_IFLNK) from None
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    handle = os.fdopen(fd, "rb")
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        handle.close()
        raise _not_regular(path, mode)
    return handle


def read_limited(path: Path, limit: int) -> bytes:
    """The bytes of regular file ``path`` (not a link), at most ``limit`` of them.

    Raises FileNotFoundError if it does not exist, :class:`CheckpointError` otherwise.
    """
    with open_regular(path) as handle:
        info = os.fstat(handle.fileno())
        if info.st_size > limit:
            raise CheckpointError(
                f"{path} is {info.st_size:,} bytes, more than the {limit:,} such a file can need; it is not a file "
                "that shardwise wrote (or was replaced): load a checkpoint you trust"
            )
        data = handle.read(limit + 1)
    if len(data) > limit:  # grew while we read it
        raise CheckpointError(f"{path} is larger than the {limit:,} bytes such a file can need")
    return data


def read_json(path: Path, limit: int) -> Any:
    """The JSON value in ``path``, read as :func:`read_limited` does."""
    data = read_limited(path, limit)
    try:
        return json.loads(data)
    except RecursionError:
        raise CheckpointError(f"{path} nests its values too deeply to be a file shardwise wrote") from None
    except ValueError as exc:  # also UnicodeDecodeError
        raise CheckpointError(f"{path} is not valid JSON ({exc}); the file is damaged") from None


def regular_size(path: Path) -> int | None:
    """The size of regular file ``path`` (None if absent); a link or anything else is refused."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode):
        raise _not_regular(path, info.st_mode)
    return info.st_size


def is_real_dir(path: Path) -> bool:
    """``path`` is a directory and not a symbolic link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False
