"""Where a checkpoint's files live, and how to tell a complete checkpoint from a broken one.

::

    SAVE_DIR/
      latest                    the tag of the newest complete checkpoint (replaced atomically)
      TAG/                      one complete checkpoint (a directory appears under its tag only
        shardwise.json            once every rank's files are flushed: see commit.py)
        rank0.json ... rankN-1.json
        __0_0.distcp ... __N-1_0.distcp
        .metadata
      .tmp-TAG-NONCE/           a save in progress, or what a crash left: never used by `latest`

``shardwise.json`` (the manifest, written by rank 0) describes the run: world
size, ZeRO stage, dtype, step counters, every parameter's shape, tied-weight
aliases, optimizer hyperparameters and state layout, scheduler and loss-scaler
state and ``client_state``, all as JSON.  ``__R_0.distcp`` is rank ``R``'s
tensor file; ``rankR.json`` (RNG state, and the world size) is written right
after it is flushed, so it marks that rank's file complete; ``.metadata`` is
the DCP index of every tensor chunk, written by rank 0 once all ranks are done.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional

from . import files
from .errors import CheckpointError
from .formats import foreign_format
from .limits import MAX_LATEST_BYTES, MAX_MANIFEST_BYTES, MAX_RANK_FILE_BYTES, MAX_TAG_LENGTH, MAX_WORLD_SIZE

__all__ = [
    "GROUP_MANIFEST", "LATEST", "MANIFEST", "TEMP_PREFIX", "check_complete", "list_checkpoints", "rank_file", "read_json",
    "read_latest", "read_rank_file", "resolve", "temp_dir", "validate_tag",
]

MANIFEST = "shardwise.json"
#: a checkpoint of several engines: their names, next to one subdirectory each (group.py)
GROUP_MANIFEST = "engines.json"
LATEST = "latest"
TEMP_PREFIX = ".tmp-"
INDEX = ".metadata"
FORMAT = "shardwise.checkpoint"
VERSION = 1

# A tag is one directory name: no separator, no `..`, nothing hidden, no newline (`fullmatch`, not `match`).
_TAG_OK = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")
# What `load_checkpoint(tag=...)` may name: a tag, or an unfinished `.tmp-TAG-NONCE` (to be told what is missing).
_NAME_OK = re.compile(r"[A-Za-z0-9_.+=-]+")
_SHOWN = 12  # missing files listed in an error


def rank_file(rank: int) -> str:
    return f"rank{rank}.json"


def _is_tag(tag: Any) -> bool:
    return isinstance(tag, str) and len(tag) <= MAX_TAG_LENGTH and bool(_TAG_OK.fullmatch(tag)) and tag != LATEST


def validate_tag(tag: Any) -> str:
    """``tag`` if it can name a directory here; a clear error otherwise."""
    if not _is_tag(tag):
        raise CheckpointError(
            f"checkpoint tag {tag!r:.100} cannot name a checkpoint directory: use letters, digits and `_.+=-` "
            f"(at most {MAX_TAG_LENGTH}), not starting with `.` or `-`, and not `{LATEST}` (e.g. `global_step100`)"
        )
    return tag


def temp_dir(save_dir: Path, tag: str, nonce: str) -> Path:
    return save_dir / f"{TEMP_PREFIX}{tag}-{nonce}"


def read_json(path: Path, limit: int = MAX_MANIFEST_BYTES) -> Any:
    """The JSON in ``path`` (a regular file, not a link, at most ``limit`` bytes)."""
    return files.read_json(path, limit)


def read_latest(root: Path) -> str:
    """The tag ``root/latest`` names (FileNotFoundError if there is none); anything else than one tag is refused."""
    file = root / LATEST
    text = files.read_limited(file, MAX_LATEST_BYTES).decode("utf-8", errors="replace").strip()
    if not _is_tag(text):
        raise CheckpointError(
            f"{file} names {text!r:.100}, which is not a checkpoint tag (one directory name: letters, digits and "
            "`_.+=-`, no path separator, no `..`): it was edited or is not shardwise's. Write the tag of a "
            f"checkpoint in {root} into it, or pass `tag=`"
        )
    return text


def _tags(save_dir: Path) -> list[str]:
    if not save_dir.is_dir():
        return []
    return sorted(
        p.name for p in save_dir.iterdir()
        if not p.name.startswith(".") and files.is_real_dir(p) and _is_checkpoint(p)
    )


def _entry(root: Path, name: Any, what: str) -> Path:
    """``root/name`` for a checkpoint name from the user or from ``latest``: one real directory inside ``root``."""
    if not isinstance(name, str) or len(name) > MAX_TAG_LENGTH or not _NAME_OK.fullmatch(name) or name in (".", ".."):
        raise CheckpointError(
            f"{what} {name!r:.100} is not the name of a checkpoint in {root}: a tag is one directory name "
            f"(letters, digits and `_.+=-`, no path separator, no `..`); tags there: {_tags(root)}"
        )
    path = root / name
    if os.path.islink(path):
        raise CheckpointError(
            f"{path} is a symbolic link; shardwise never follows a link from a checkpoint name, so a checkpoint "
            "cannot make it read another directory: load the directory it points to directly"
        )
    return path


def resolve(load_dir: str | os.PathLike[str], tag: Optional[str]) -> Path:
    """The checkpoint directory for ``load_dir`` and ``tag`` (``None``: the one ``latest`` names).

    ``load_dir`` may also be a checkpoint directory itself (``tag=None``).
    The result is always ``load_dir`` or one real directory inside it.
    """
    root = Path(load_dir)
    if tag is not None:
        return _entry(root, tag, "tag")
    if os.path.lexists(root / LATEST):
        return _entry(root, read_latest(root), f"{root / LATEST} names")
    if (root / MANIFEST).is_file() or (root / INDEX).is_file() or (root / GROUP_MANIFEST).is_file():
        return root
    foreign = foreign_format(root)
    if foreign is not None:
        raise CheckpointError(foreign)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist; pass the `save_dir` given to `save_checkpoint`")
    raise CheckpointError(
        f"{root} has no `{LATEST}` file, so there is no complete checkpoint to pick (tags found: {_tags(root)}); "
        "pass `tag=` to load a specific one"
    )


def check_complete(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint in ``path``, checked against its index and files.

    Raises naming every missing or short file, or the first field that a
    checkpoint shardwise wrote could not hold (see ``validate.py``).
    """
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (tags in {path.parent}: {_tags(path.parent)})")
    foreign = foreign_format(path)
    if foreign is not None:
        raise CheckpointError(foreign)
    _verify_index(path)
    metadata = _index(path)
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
    return _checked_manifest(path, metadata)


def _checked_manifest(path: Path, metadata: Any) -> dict[str, Any]:
    from .validate import check_against_index, check_manifest

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
    _check_listed(path, manifest, metadata)
    return manifest


def _check_listed(path: Path, manifest: dict[str, Any], metadata: Any) -> None:
    """Every file a load of ``path`` may read has its checksum in the manifest (else none is checked)."""
    from .digests import expected_digests, require_listed
    from .validate_index import record_ends

    data = sorted(record_ends(metadata.storage_data, path / INDEX))
    ranks = [rank_file(r) for r in range(manifest["world_size"])]
    require_listed(path, [INDEX, *ranks, *data], expected_digests(manifest, path / MANIFEST))


def read_rank_file(path: Path, rank: int, world_size: int, expected: dict[str, Any]) -> dict[str, Any]:
    """Rank ``rank``'s ``rankR.json`` in checkpoint ``path``, checked: its checksum (``expected``: the
    manifest's ``files``), its RNG state can be set, and every tensor it refers to has that size in the index."""
    from .digests import verify
    from .storage import read_metadata
    from .validate import check_rank_file

    verify(path, rank_file(rank), expected)
    file = path / rank_file(rank)
    info = read_json(file, MAX_RANK_FILE_BYTES)
    check_rank_file(info, rank, world_size, read_metadata(path).state_dict_metadata, file)
    return info


def _verify_index(path: Path) -> None:
    """The ``.metadata`` index has the checksum the manifest recorded, before anything unpickles it."""
    from .digests import expected_digests, verify

    if files.regular_size(path / INDEX) is None or files.regular_size(path / MANIFEST) is None:
        return  # reported as missing, with the rest
    verify(path, INDEX, expected_digests(read_json(path / MANIFEST), path / MANIFEST))


def _index(path: Path) -> Any:
    """The checked DCP index of ``path``, or None when there is no ``.metadata``."""
    from .storage import read_metadata

    if files.regular_size(path / INDEX) is None:
        return None
    return read_metadata(path)


def _world_size(path: Path) -> Optional[int]:
    candidates = [path / MANIFEST, *sorted(path.glob("rank*.json"))[:8]]
    for candidate in candidates:
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
    missing = [name for name in (MANIFEST, INDEX) if files.regular_size(path / name) is None]
    world = _world_size(path)
    if world is None:
        return missing + ["every rank's tensor file (none was started)"]
    for r in range(world):
        # `rankR.json` is written right after rank R's tensor file is flushed: without it,
        # that file is absent or cut short.
        if files.regular_size(path / rank_file(r)) is None:
            missing += [f"__{r}_0.distcp (rank {r} did not finish writing it)", rank_file(r)]
    if metadata is None:
        return missing
    from .validate_index import record_ends

    for name, size in sorted(record_ends(metadata.storage_data, path / INDEX).items()):
        actual = files.regular_size(path / name)
        if actual is None or actual < size:
            missing.append(name)
    return missing


def list_checkpoints(save_dir: Path) -> list[tuple[str, Path, bool]]:
    """``(name, path, committed)`` for every checkpoint directory in ``save_dir``, in name order (links skipped)."""
    found = []
    for child in sorted(save_dir.iterdir()) if save_dir.is_dir() else []:
        if not files.is_real_dir(child):
            continue
        if child.name.startswith(TEMP_PREFIX):
            found.append((child.name, child, False))
        elif _is_checkpoint(child):
            found.append((child.name, child, True))
    return found


def _is_checkpoint(path: Path) -> bool:
    """A committed checkpoint: of one engine (its manifest), or of several (their list)."""
    return (path / MANIFEST).is_file() or (path / GROUP_MANIFEST).is_file()
