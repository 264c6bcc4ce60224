"""Atomic commit: a checkpoint becomes visible only once all of it is on disk.

Every rank writes into ``.tmp-TAG-NONCE/`` and flushes (``fsync``) its files.
Only after every rank has finished does rank 0 (the only rank that renames)

1. fsync the temporary directory, so its entries are durable;
2. rename it to ``TAG`` (``rename`` is atomic on POSIX file systems);
3. fsync ``SAVE_DIR`` and replace ``latest`` through a temporary file and
   ``os.replace``, then fsync ``SAVE_DIR`` again.

Every file written here goes through :func:`write_atomic`: a new file under a
random name, created exclusively and never through a symlink, then renamed
into place, so links planted in ``SAVE_DIR`` cannot redirect a write.

A crash before step 2 leaves only a ``.tmp-*`` directory, which ``latest``
never names; a crash between 2 and 3 leaves the new checkpoint complete but
``latest`` still naming the previous one.  Overwriting an existing tag moves
the old directory aside first and deletes it after the rename.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

from .layout import LATEST, TEMP_PREFIX

__all__ = ["commit", "fsync_dir", "remove_stale_temps", "write_atomic", "write_json"]


def fsync_dir(path: Path) -> None:
    """Make ``path``'s entries (creations, renames) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not supported here (e.g. Windows): renames are as durable as the OS makes them
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new, empty file next to ``path`` under a random name, created by this call and nobody else.

    ``O_CREAT | O_EXCL`` fails if anything (a planted symlink included) has the
    name, and ``O_NOFOLLOW`` refuses a link even where ``O_EXCL`` alone would not;
    the random suffix makes the name impossible to plant in advance.
    Unlike ``tempfile.mkstemp``, the file gets the mode ``open`` gives (0666 less
    the umask), so a checkpoint stays readable by the group as before.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.with_name(f"{TEMP_PREFIX}{path.name}.{secrets.token_hex(8)}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file next to {path}")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one, never a part.

    The data goes to a fresh temporary file (:func:`_create_temp`) that is
    renamed over ``path``: a rename replaces a symlink at ``path`` itself and
    never writes through it, so no link planted in the directory can redirect
    the write to another file.
    """
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


def remove_stale_temps(save_dir: Path, tag: str) -> None:
    """Delete directories that earlier, failed saves of ``tag`` left behind."""
    pattern = re.compile(re.escape(f"{TEMP_PREFIX}{tag}-") + r"[0-9a-f]{12}(\.replaced)?")
    for child in save_dir.glob(f"{TEMP_PREFIX}{tag}-*"):
        if pattern.fullmatch(child.name) and (child.is_symlink() or child.is_dir()):
            _remove(child)
