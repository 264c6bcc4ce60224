"""Telling a complete, intact checkpoint from a broken one, before anything in it is used.

:func:`check_complete`: every file the manifest and the DCP index name is there, whole, with the checksum the
manifest recorded, and the manifest passes ``validate.py`` and agrees with the index.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from . import files
from .files import MAX_MANIFEST_BYTES, MAX_RANK_FILE_BYTES, MAX_WORLD_SIZE, CheckpointError, read_json, regular_size
from .layout import FORMAT, INDEX, LATEST, MANIFEST, TEMP_PREFIX, VERSION, foreign_format, rank_file, tags
from .storage import read_metadata, record_ends
from .validate import check_against_index, check_manifest, check_rank_file

__all__ = ["check_complete", "read_rank_file"]

_SHOWN = 12  # missing files listed in an error


def check_complete(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint in ``path``, checked against its index and files; raises naming every
    missing or short file, or the first field a checkpoint shardwise wrote could not hold."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (tags in {path.parent}: {tags(path.parent)})")
    foreign = foreign_format(path)
    if foreign is not None:
        raise CheckpointError(foreign)
    has_index = regular_size(path / INDEX) is not None
    if has_index and regular_size(path / MANIFEST) is not None:  # checked before anything unpickles the index
        files.verify(path, INDEX, files.expected_digests(read_json(path / MANIFEST), path / MANIFEST))
    metadata = read_metadata(path) if has_index else None
    missing = _missing_files(path, metadata)
    if missing:
        hint = (
            "its save did not finish (a rank crashed or was killed while writing), so it was never committed"
            if path.name.startswith(TEMP_PREFIX) or MANIFEST in missing or INDEX in missing
            else "files were removed or truncated after it was written"
        )
        shown = missing[:_SHOWN] + ([f"... {len(missing) - _SHOWN} more"] if len(missing) > _SHOWN else [])
        raise CheckpointError(
            f"checkpoint {path} is incomplete: missing or truncated {shown}; {hint}. Load a complete "
            f"checkpoint instead (the one `{LATEST}` names, or another tag)"
        )
    assert metadata is not None  # `_missing_files` lists `.metadata` when there is none
    file = path / MANIFEST
    manifest = read_json(file)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("version"), int) \
            or manifest["version"] > VERSION:
        found = (manifest.get("format"), manifest.get("version")) if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(
            f"{file} is not a shardwise checkpoint manifest of version <= {VERSION} (format, version: {found!r:.100})"
        )
    refs = check_manifest(manifest, file)
    check_against_index(manifest, refs, metadata.state_dict_metadata, file)
    # every file a load may read has its checksum in the manifest (else none is checked)
    data = sorted(record_ends(metadata.storage_data, path / INDEX))
    ranks = [rank_file(r) for r in range(manifest["world_size"])]
    files.require_listed(path, [INDEX, *ranks, *data], files.expected_digests(manifest, file))
    return manifest


def read_rank_file(path: Path, rank: int, world_size: int, expected: dict[str, Any]) -> dict[str, Any]:
    """Rank ``rank``'s ``rankR.json`` in checkpoint ``path``, checked: its checksum (``expected``: the
    manifest's ``files``), its RNG state can be set, and every tensor it refers to has that size in the index."""
    files.verify(path, rank_file(rank), expected)
    file = path / rank_file(rank)
    info = read_json(file, MAX_RANK_FILE_BYTES)
    check_rank_file(info, rank, world_size, read_metadata(path).state_dict_metadata, file)
    return info


def _world_size(path: Path) -> Optional[int]:
    for candidate in [path / MANIFEST, *sorted(path.glob("rank*.json"))[:8]]:
        try:
            world = read_json(candidate, MAX_RANK_FILE_BYTES if candidate.name != MANIFEST else MAX_MANIFEST_BYTES)
        except (FileNotFoundError, CheckpointError):
            continue
        value = world.get("world_size") if isinstance(world, dict) else None
        if type(value) is int and 1 <= value <= MAX_WORLD_SIZE:
            return value
    ranks = [int(m.group(1)) for f in path.glob("__*_*.distcp") if (m := re.fullmatch(r"__(\d{1,7})_\d+\.distcp", f.name))]
    ranks = [r for r in ranks if r < MAX_WORLD_SIZE]
    return max(ranks) + 1 if ranks else None


def _missing_files(path: Path, metadata: Any) -> list[str]:
    missing = [name for name in (MANIFEST, INDEX) if regular_size(path / name) is None]
    world = _world_size(path)
    if world is None:
        return missing + ["every rank's tensor file (none was started)"]
    for r in range(world):
        # `rankR.json` is written right after rank R's tensor file is flushed: without it, that file is cut short
        if regular_size(path / rank_file(r)) is None:
            missing += [f"__{r}_0.distcp (rank {r} did not finish writing it)", rank_file(r)]
    if metadata is None:
        return missing
    for name, size in sorted(record_ends(metadata.storage_data, path / INDEX).items()):
        actual = regular_size(path / name)
        if actual is None or actual < size:
            missing.append(name)
    return missing
