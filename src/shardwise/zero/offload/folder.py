"""Offload folders under ``nvme_path``: whose each is, removing those of processes that are gone, and room on the disk
for every rank of this host that offloads there, checked before training.

A rank's folder is ``shardwise-<host>-ns<pid namespace>-pid<pid>-rank<r>-<random>`` (:func:`tempfile.mkdtemp`: unique,
made atomically).  A process killed with ``SIGKILL`` cannot remove it, so the next set-up on the host sweeps
(:func:`sweep`) every folder whose creator no longer runs, as :func:`shardwise.comm.shm.sweep` does. Only folders this
host can judge are touched: host name and pid namespace must be this process's (a pid means nothing on another host or
container), the folder this user's, its creator not running.  A reused pid keeps its folder (a leak, never a loss).

Room: ranks of one host usually share one disk, and a check of one rank passes for each while together they fill it.  So
a rank first writes its need into its own folder (a *claim*, ``.room``, written whole by a rename), then adds up the
claims of every live folder of this host on the same file system (``st_dev``), less what each has written already, and
compares with the free space (:func:`claim_room`).  Of any two ranks the later to check sees both claims, so when they
do not fit at least one raises (the others learn it from the fault layer).  Folders of other hosts are not counted.
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

__all__ = [
    "CLAIM", "Claim", "Owner", "claim_room", "claims_beside", "folder_prefix", "is_ours_to_judge", "owner_of", "sweep",
]

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
    """Remove the folders under ``root`` made on this host by this user's processes that are gone.  Returns the names
    removed.  A folder that cannot be read or removed is left alone: the sweep never makes a set-up fail.
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


# ------------------------------------------------- room on the disk for every live folder
#: the file in a rank's folder that says how many bytes the rank needs there
CLAIM = ".room"  # hidden: no optimizer state kind is named so


@dataclass(frozen=True)
class Claim:
    """One live rank's folder: the bytes it needs on the disk and those it has yet to write."""

    folder: Path
    rank: int
    pid: int
    needed: int
    to_write: int


def _write_claim(folder: Path, needed: int) -> None:
    partial = folder / f"{CLAIM}.partial"
    partial.write_text(str(needed))
    os.replace(partial, folder / CLAIM)  # a reader sees the whole number or no claim


def _written(folder: Path) -> int:
    """Bytes the folder's files take on disk (sparse parts excluded, block rounding not counted)."""
    total = 0
    for entry in os.scandir(folder):
        if entry.name in (CLAIM, f"{CLAIM}.partial"):
            continue
        stat = entry.stat(follow_symlinks=False)
        total += min(stat.st_size, stat.st_blocks * 512)
    return total


def _claim_of(folder: Path, device: int) -> Claim | None:
    """The claim of ``folder`` when it is a live folder of this host on ``device`` with a claim written."""
    owner = owner_of(folder.name)
    if owner is None or not is_ours_to_judge(owner) or not running(owner.pid):
        return None
    try:
        if folder.stat().st_dev != device:
            return None
        needed = int((folder / CLAIM).read_text())
        return Claim(folder, owner.rank, owner.pid, needed, max(0, needed - _written(folder)))
    except (OSError, ValueError):
        return None  # not claimed yet, or removed meanwhile


def claims_beside(folder: Path) -> list[Claim]:
    """The claims of the live folders of this host next to ``folder`` (itself included) on its file system."""
    device = folder.stat().st_dev
    found = [_claim_of(path, device) for path in folder.parent.iterdir()]
    return sorted((c for c in found if c is not None), key=lambda c: (c.folder != folder, c.rank, c.pid))


def claim_room(folder: Path, needed: int, rank: int, what: str, key: str, label: str) -> None:
    """Claim ``needed`` bytes for ``folder``'s rank and raise when this host's ranks on the disk do not fit.  ``what``
    says what the bytes are for; ``key`` and ``label`` are the config key and the state errors name."""
    _write_claim(folder, needed)
    free = shutil.disk_usage(folder).free
    claims = claims_beside(folder)
    if sum(c.to_write for c in claims) <= free:
        return
    root = str(folder.parent)
    if len(claims) <= 1:
        raise RuntimeError(
            f"rank {rank}: `{key}` {root!r} has {free:,} bytes free and this rank's {label} needs {needed:,} "
            f"({what}); free space there, point `{key}` at a larger disk, or use more ranks")
    raise RuntimeError(_shared_message(rank, root, free, claims, what, key))


def _shared_message(rank: int, root: str, free: int, claims: list[Claim], what: str, key: str) -> str:
    total = sum(c.to_write for c in claims)
    each = "; ".join(
        f"rank {c.rank} (pid {c.pid}{', this rank: ' + what if i == 0 else ''}): {c.to_write:,} still to write"
        + (f" of {c.needed:,}" if c.to_write != c.needed else "") for i, c in enumerate(claims))
    return (f"rank {rank}: `{key}` {root!r} has {free:,} bytes free, and the {len(claims)} ranks of this host "
            f"offloading to that disk need {total:,} bytes more there together ({each}); free space there, "
            f"give each rank its own disk (`{key}`), or spread the ranks over more hosts")
