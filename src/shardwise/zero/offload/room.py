"""Room on the disk under ``nvme_path`` for every rank of this host that offloads there, checked before training.

Ranks of one host usually share one disk: a check of one rank passes for each while together they fill it.
So a rank first writes its need into its own folder (a *claim*, ``.room``, written whole by a rename), then adds
up the claims of every live folder of this host on the same file system (``st_dev``), less what each has
written already, and compares with the free space.  Of any two ranks the later to check sees both claims, so
when they do not fit at least one raises (the others learn it from the fault layer).  Folders of other hosts
are not counted (:mod:`.folder`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ...comm.processes import running
from .folder import is_ours_to_judge, owner_of

__all__ = ["CLAIM", "Claim", "claim_room", "claims_beside"]

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
    """Claim ``needed`` bytes for ``folder``'s rank and raise when this host's ranks on the disk do not fit.

    ``what`` says what the bytes are for; ``key`` and ``label`` are the config key and the state errors name."""
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
