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

import json
import os
import re
from pathlib import Path
from typing import Any, Optional

from .errors import CheckpointError

__all__ = [
    "LATEST", "MANIFEST", "TEMP_PREFIX", "check_complete", "list_checkpoints", "rank_file",
    "read_json", "resolve", "temp_dir", "validate_tag",
]

MANIFEST = "shardwise.json"
LATEST = "latest"
TEMP_PREFIX = ".tmp-"
INDEX = ".metadata"
FORMAT = "shardwise.checkpoint"
VERSION = 1

_TAG_OK = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=-]*$")


def rank_file(rank: int) -> str:
    return f"rank{rank}.json"


def validate_tag(tag: Any) -> str:
    """``tag`` if it can name a directory here; a clear error otherwise."""
    if not isinstance(tag, str) or not _TAG_OK.match(tag) or tag == LATEST:
        raise CheckpointError(
            f"checkpoint tag {tag!r} cannot name a checkpoint directory: use letters, digits and `_.+=-`, "
            f"not starting with `.` or `-`, and not `{LATEST}` (e.g. `global_step100`)"
        )
    return tag


def temp_dir(save_dir: Path, tag: str, nonce: str) -> Path:
    return save_dir / f"{TEMP_PREFIX}{tag}-{nonce}"


def read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc


def _tags(save_dir: Path) -> list[str]:
    if not save_dir.is_dir():
        return []
    return sorted(p.name for p in save_dir.iterdir() if (p / MANIFEST).is_file() and not p.name.startswith("."))


def resolve(load_dir: str | os.PathLike[str], tag: Optional[str]) -> Path:
    """The checkpoint directory for ``load_dir`` and ``tag`` (``None``: the one ``latest`` names).

    ``load_dir`` may also be a checkpoint directory itself (``tag=None``).
    """
    root = Path(load_dir)
    if tag is not None:
        return root / str(tag)
    latest = root / LATEST
    if latest.is_file():
        name = latest.read_text(encoding="utf-8").strip()
        return root / name
    if (root / MANIFEST).is_file() or (root / INDEX).is_file():
        return root
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist; pass the `save_dir` given to `save_checkpoint`")
    raise CheckpointError(
        f"{root} has no `{LATEST}` file, so there is no complete checkpoint to pick (tags found: {_tags(root)}); "
        "pass `tag=` to load a specific one"
    )


def check_complete(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint in ``path``; raises naming every missing or short file."""
    if not path.is_dir():
        tags = _tags(path.parent)
        raise CheckpointError(f"checkpoint {path} does not exist (tags in {path.parent}: {tags})")
    missing = _missing_files(path)
    if missing:
        hint = (
            "its save did not finish (a rank crashed or was killed while writing), so it was never committed"
            if path.name.startswith(TEMP_PREFIX) or MANIFEST in missing or INDEX in missing
            else "files were removed or truncated after it was written"
        )
        raise CheckpointError(
            f"checkpoint {path} is incomplete: missing or truncated {missing}; {hint}. Load a complete "
            f"checkpoint instead (the one `{LATEST}` names, or another tag)"
        )
    manifest = read_json(path / MANIFEST)
    if manifest.get("format") != FORMAT or manifest.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{path / MANIFEST} is not a shardwise checkpoint manifest of version <= {VERSION} "
            f"(format {manifest.get('format')!r}, version {manifest.get('version')!r})"
        )
    return manifest


def _world_size(path: Path) -> Optional[int]:
    for candidate in [path / MANIFEST, *sorted(path.glob("rank*.json"))]:
        try:
            return int(read_json(candidate)["world_size"])
        except (FileNotFoundError, KeyError, TypeError, ValueError, CheckpointError):
            continue
    ranks = [int(m.group(1)) for f in path.glob("__*_*.distcp") if (m := re.match(r"__(\d+)_", f.name))]
    return max(ranks) + 1 if ranks else None


def _missing_files(path: Path) -> list[str]:
    missing = [name for name in (MANIFEST, INDEX) if not (path / name).is_file()]
    world = _world_size(path)
    if world is None:
        return missing + ["every rank's tensor file (none was started)"]
    for r in range(world):
        # `rankR.json` is written right after rank R's tensor file is flushed: without it,
        # that file is absent or cut short.
        if not (path / rank_file(r)).is_file():
            missing += [f"__{r}_0.distcp (rank {r} did not finish writing it)", rank_file(r)]
    if INDEX in missing:
        return missing
    from .storage import read_metadata

    needed: dict[str, int] = {}
    for info in read_metadata(path).storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file() or file.stat().st_size < size:
            missing.append(name)
    return missing


def list_checkpoints(save_dir: Path) -> list[tuple[str, Path, bool]]:
    """``(name, path, committed)`` for every checkpoint directory in ``save_dir``, in name order."""
    found = []
    for child in sorted(save_dir.iterdir()) if save_dir.is_dir() else []:
        if child.is_dir() and child.name.startswith(TEMP_PREFIX):
            found.append((child.name, child, False))
        elif child.is_dir() and (child / MANIFEST).is_file():
            found.append((child.name, child, True))
    return found
