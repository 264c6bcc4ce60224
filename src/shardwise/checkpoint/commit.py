"""Atomic commit: a checkpoint becomes visible only once all of it is on disk.

Every rank writes into ``.tmp-TAG-NONCE/`` and flushes (``fsync``) its files.
Only after every rank has finished does rank 0 (the only rank that renames)

1. fsync the temporary directory, so its entries are durable;
2. rename it to ``TAG`` (``rename`` is atomic on POSIX file systems);
3. fsync ``SAVE_DIR`` and replace ``latest`` through a temporary file and
   ``os.replace``, then fsync ``SAVE_DIR`` again.

A crash before step 2 leaves only a ``.tmp-*`` directory, which ``latest``
never names; a crash between 2 and 3 leaves the new checkpoint complete but
``latest`` still naming the previous one.  Overwriting an existing tag moves
the old directory aside first and deletes it after the rename.
"""

from __future__ import annotations

import json
import os
import re
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


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one, never a part."""
    tmp = path.with_name(f"{TEMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=1, allow_nan=False).encode())


def commit(temp: Path, final: Path) -> None:
    """Rename the finished ``temp`` directory to ``final`` and point ``latest`` at it."""
    fsync_dir(temp)
    old = None
    if final.exists():
        old = final.with_name(f"{temp.name}.replaced")
        os.rename(final, old)
    os.rename(temp, final)
    fsync_dir(final.parent)
    write_atomic(final.parent / LATEST, final.name.encode())
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_stale_temps(save_dir: Path, tag: str) -> None:
    """Delete directories that earlier, failed saves of ``tag`` left behind."""
    pattern = re.compile(re.escape(f"{TEMP_PREFIX}{tag}-") + r"[0-9a-f]{12}(\.replaced)?")
    for child in save_dir.glob(f"{TEMP_PREFIX}{tag}-*"):
        if child.is_dir() and pattern.fullmatch(child.name):
            shutil.rmtree(child, ignore_errors=True)
