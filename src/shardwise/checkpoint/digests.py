"""Checksums of a checkpoint's files, so a flipped byte or a cut file is refused at load, naming the file.

At save, each rank hashes the files it wrote (its tensor file and ``rankR.json``)
once they are flushed, and rank 0 the index (``.metadata``) and the 16-bit
weights; the manifest lists them all: ``"files": {name: {"bytes": n, "sha256":
hex}}``.  At load, every file is checked before it is parsed or read from:
the index before it is unpickled, a rank file before its JSON is used, a tensor
file before DCP reads a record of it (each rank checks the files it reads).

SHA-256 runs at about 1 GB/s on one core, so checking costs one more pass over
the bytes a rank reads (from the page cache, right before DCP reads them).
Manifests written before checksums existed have no ``files`` entry and load
unchecked.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any, Iterable, Optional

from .errors import CheckpointError

__all__ = ["digest", "digests", "expected_digests", "verify"]

_HEX = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20


def digest(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of the file at ``path``."""
    hasher = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            hasher.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": hasher.hexdigest()}


def digests(root: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{name: digest(root / name)}`` for each name."""
    return {name: digest(root / name) for name in sorted(set(names))}


def expected_digests(manifest: Any) -> Optional[dict[str, dict[str, Any]]]:
    """The manifest's ``files`` entry, checked to be well formed; None for a manifest written without one."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if files is None:
        return None
    good = isinstance(files, dict) and all(
        isinstance(name, str) and isinstance(entry, dict) and type(entry.get("bytes")) is int
        and isinstance(entry.get("sha256"), str) and _HEX.fullmatch(entry["sha256"]) is not None
        for name, entry in files.items())
    if not good:
        raise CheckpointError("the manifest's `files` entry is not a map of file name -> {bytes, sha256}; the "
                              "manifest is damaged or was edited by hand")
    return files


def verify(root: Path, name: str, expected: Optional[dict[str, dict[str, Any]]]) -> None:
    """Raise unless ``root / name`` has the size and SHA-256 the manifest recorded (no record: no check)."""
    if expected is None:
        return
    want = expected.get(name)
    if want is None:
        raise CheckpointError(
            f"{root / name} is not among the files the manifest of {root} lists with checksums; the checkpoint "
            "was assembled from pieces of different saves: load a checkpoint as it was written"
        )
    got = digest(root / name)
    if got != {"bytes": want["bytes"], "sha256": want["sha256"]}:
        what = (f"{got['bytes']:,} bytes where the save wrote {want['bytes']:,}" if got["bytes"] != want["bytes"]
                else f"SHA-256 {got['sha256'][:16]}... where the save recorded {want['sha256'][:16]}...")
        raise CheckpointError(
            f"checkpoint file {root / name} is corrupted: {what}; it changed after the save finished (a disk, "
            "copy or transfer error, or an edit). Restore it from a good copy, or load another checkpoint"
        )
