"""Whose an offload folder under ``nvme_path`` is, and removing the folders of processes that are gone.

A rank's folder is ``shardwise-<host>-ns<pid namespace>-pid<pid>-rank<r>-<random>`` (:func:`tempfile.mkdtemp`:
unique, made atomically).  A process killed with ``SIGKILL`` cannot remove it, so the next set-up on the host
sweeps (:func:`sweep`) every folder whose creator no longer runs, as :func:`shardwise.comm.shm.sweep` does.
Only folders this host can judge are touched: host name and pid namespace must be this process's (a pid means
nothing on another host or container), the folder this user's, its creator not running.  A reused pid keeps
its folder (a leak, never a loss).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ...comm.processes import running

__all__ = ["Owner", "folder_prefix", "is_ours_to_judge", "owner_of", "sweep"]

_NAME = re.compile(r"shardwise-(?P<host>[A-Za-z0-9.-]+)-ns(?P<ns>\d+)-pid(?P<pid>\d+)-rank(?P<rank>\d+)-[A-Za-z0-9_]+")


@dataclass(frozen=True)
class Owner:
    """The process that made an offload folder, as its name says."""

    host: str
    namespace: int
    pid: int
    rank: int


@functools.lru_cache(maxsize=1)
def _host() -> str:
    """This host's name, kept to the characters a folder name may hold."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "unknown-host"


def _namespace() -> int:
    """This process's pid namespace (0 where ``/proc`` does not say: then every process shares it)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def folder_prefix(rank: int) -> str:
    """The start of this process's folder names (``mkdtemp`` adds the random part)."""
    return f"shardwise-{_host()}-ns{_namespace()}-pid{os.getpid()}-rank{rank}-"


def owner_of(name: str) -> Optional[Owner]:
    """Who made the folder called ``name``; None for a name that is not an offload folder's."""
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    return Owner(match["host"], int(match["ns"]), int(match["pid"]), int(match["rank"]))


def is_ours_to_judge(owner: Owner) -> bool:
    """Whether ``owner``'s process id can be checked from here (same host, same pid namespace)."""
    return owner.host == _host() and owner.namespace == _namespace()


def sweep(root: str) -> list[str]:
    """Remove the folders under ``root`` made on this host by this user's processes that are gone.

    Returns the names removed.  A folder that cannot be read or removed is left alone: the sweep never
    makes a set-up fail.
    """
    try:
        names = os.listdir(root)
    except OSError:
        return []
    removed = []
    for name in names:
        owner = owner_of(name)
        if owner is None or not is_ours_to_judge(owner) or running(owner.pid):
            continue
        path = Path(root) / name
        try:
            if not path.is_dir() or path.is_symlink() or path.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)  # two set-ups may sweep the same folder at once
        removed.append(name)
    return removed
