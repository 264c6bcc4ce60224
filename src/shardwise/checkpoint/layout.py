"""Where a checkpoint's files live, how a load finds one, and what a directory of another kind is.

The layout is drawn in ``docs/checkpoints.md`` ("On-disk layout"); ``TAG/`` appears only once every rank's files
are flushed (commit.py).  A checkpoint of several engines is ``TAG/engines.json`` and one such directory per engine
(``group.py``).  :func:`foreign_format` names a DeepSpeed, plain DCP, Hugging Face or ``torch.save`` path (by names
and magic bytes only), which would otherwise look like an unfinished save or a missing directory.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any, Optional

from .files import MAX_LATEST_BYTES, MAX_TAG_LENGTH, CheckpointError, is_real_dir, read_json, read_limited

__all__ = [
    "FORMAT", "GROUP_FORMAT", "GROUP_MANIFEST", "INDEX", "LATEST", "MANIFEST", "MODEL_STATES", "TEMP_PREFIX", "VERSION",
    "find_deepspeed", "foreign_format", "holds_none", "list_checkpoints", "member_path", "rank_file", "read_group",
    "read_latest", "resolve", "tags", "temp_dir", "validate_tag",
]

MANIFEST = "shardwise.json"
GROUP_MANIFEST = "engines.json"  # a checkpoint of several engines: their names, next to one subdirectory each
GROUP_FORMAT = "shardwise.engine.multi"
_MAX_GROUP_BYTES = 1 << 20
LATEST = "latest"
TEMP_PREFIX = ".tmp-"
INDEX = ".metadata"
MODEL_STATES = "mp_rank_00_model_states.pt"  # DeepSpeed's model states at stages 0-2 (stage 3: one per rank)
FORMAT = "shardwise.checkpoint"
VERSION = 1

# A tag is one directory name: no separator, no `..`, nothing hidden, no newline (`fullmatch`, not `match`).
_TAG_OK = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")
# What `load_checkpoint(tag=...)` may name: a tag, or an unfinished `.tmp-TAG-NONCE` (to be told what is missing).
_NAME_OK = re.compile(r"[A-Za-z0-9_.+=-]+")
_DEEPSPEED = re.compile(
    r"(mp_rank_\d+_model_states\.pt|(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_(optim|model)_states\.pt"
    r"|layer_\d+-model_\d+-model_states\.pt|zero_to_fp32\.py)"
)


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


def read_latest(root: Path) -> str:
    """The tag ``root/latest`` names (FileNotFoundError if there is none); anything else than one tag is refused."""
    file = root / LATEST
    text = read_limited(file, MAX_LATEST_BYTES).decode("utf-8", errors="replace").strip()
    if not _is_tag(text):
        raise CheckpointError(
            f"{file} names {text!r:.100}, which is not a checkpoint tag (one directory name: letters, digits and "
            "`_.+=-`, no path separator, no `..`): it was edited or is not shardwise's. Write the tag of a "
            f"checkpoint in {root} into it, or pass `tag=`"
        )
    return text


def tags(save_dir: Path) -> list[str]:
    """The committed checkpoints in ``save_dir`` by tag, in name order (links and hidden names skipped)."""
    if not save_dir.is_dir():
        return []
    found = [p for p in save_dir.iterdir() if not p.name.startswith(".") and is_real_dir(p) and _is_checkpoint(p)]
    return sorted(p.name for p in found)


def _entry(root: Path, name: Any, what: str) -> Path:
    """``root/name`` for a checkpoint name from the user or from ``latest``: one real directory inside ``root``."""
    if not isinstance(name, str) or len(name) > MAX_TAG_LENGTH or not _NAME_OK.fullmatch(name) or name in (".", ".."):
        raise CheckpointError(
            f"{what} {name!r:.100} is not the name of a checkpoint in {root}: a tag is one directory name "
            f"(letters, digits and `_.+=-`, no path separator, no `..`); tags there: {tags(root)}"
        )
    path = root / name
    if os.path.islink(path):
        raise CheckpointError(
            f"{path} is a symbolic link; shardwise never follows a link from a checkpoint name, so a checkpoint "
            "cannot make it read another directory: load the directory it points to directly"
        )
    return path


def resolve(load_dir: str | os.PathLike[str], tag: Optional[str]) -> Path:
    """The checkpoint directory for ``load_dir`` and ``tag`` (``None``: the one ``latest`` names, or
    ``load_dir`` itself when it is a checkpoint); always ``load_dir`` or one real directory inside it."""
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
        f"{root} has no `{LATEST}` file, so there is no complete checkpoint to pick (tags found: {tags(root)}); "
        "pass `tag=` to load a specific one"
    )


def holds_none(load_dir: Path) -> bool:
    """``load_dir`` has neither `latest` nor any complete checkpoint (nor one of another kind: the load names it)."""
    if (load_dir / LATEST).is_file() or (load_dir / MANIFEST).is_file() or (load_dir / GROUP_MANIFEST).is_file() \
            or foreign_format(load_dir) is not None:
        return False
    return not any(committed for _, _, committed in list_checkpoints(load_dir))


def list_checkpoints(save_dir: Path) -> list[tuple[str, Path, bool]]:
    """``(name, path, committed)`` for every checkpoint directory in ``save_dir``, in name order (links skipped)."""
    found = []
    for child in sorted(save_dir.iterdir()) if save_dir.is_dir() else []:
        if is_real_dir(child) and (child.name.startswith(TEMP_PREFIX) or _is_checkpoint(child)):
            found.append((child.name, child, not child.name.startswith(TEMP_PREFIX)))
    return found


def _is_checkpoint(path: Path) -> bool:
    """A committed checkpoint: of one engine (its manifest), or of several (their list)."""
    return (path / MANIFEST).is_file() or (path / GROUP_MANIFEST).is_file()


def read_group(path: Path) -> list[str]:
    """The engine names of the multi-engine checkpoint in ``path``, checked."""
    data = read_json(path / GROUP_MANIFEST, _MAX_GROUP_BYTES)
    names = data.get("engines") if isinstance(data, dict) and data.get("format") == GROUP_FORMAT else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"{path / GROUP_MANIFEST} is not a shardwise list of engines; refusing it")
    for name in names:
        validate_tag(name)
    return names


def member_path(path: Path, name: Optional[str]) -> Path:
    """The checkpoint of engine ``name`` inside ``path``: ``path`` itself for a one-engine checkpoint,
    ``path/<name>`` for a checkpoint of several engines."""
    if not (path / GROUP_MANIFEST).is_file():
        return path
    names = read_group(path)
    if name is None:
        raise CheckpointError(
            f"{path} holds the checkpoints of several engines {names}; build this engine with "
            "`shardwise.initialize(..., name=...)` using one of those names, or use `shardwise.load_checkpoints`"
        )
    if name not in names:
        raise CheckpointError(f"{path} holds the checkpoints of engines {names}, not of `{name}`; pass the tag of a "
                              f"checkpoint that has it, or build the engine with one of those names")
    member = path / name
    if not is_real_dir(member):
        raise CheckpointError(f"{member} is not a directory of this checkpoint (a link, or removed); refusing it")
    return member


# ------------------------------------------------------------ other formats


def foreign_format(path: Path) -> Optional[str]:
    """What ``path`` is, as a sentence with the fix, when it is a checkpoint shardwise does not read; else None."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        try:
            with open(path, "rb") as handle:
                head = handle.read(16)
        except OSError:
            head = b""
        if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
            kind = "a single file saved with `torch.save`"
            fix = "load it with `model.load_state_dict(torch.load(FILE, weights_only=True))` before `shardwise.initialize`"
        elif len(head) >= 9 and head[8:9] == b"{":
            kind = "a safetensors file"
            fix = "load it with `shardwise.checkpoint.load_consolidated(FILE)` (or `safetensors.torch.load_file`) and `model.load_state_dict`"
        else:
            kind = "a file"
            fix = "pass the `save_dir` given to `save_checkpoint`, or one checkpoint directory in it"
        return f"{path} is {kind}, not a shardwise checkpoint directory: {fix}"
    if not stat.S_ISDIR(mode):
        return None
    names = _names(path)
    if MANIFEST in names:
        return None
    found = sorted(n for n in names if _DEEPSPEED.fullmatch(n))
    tag = _latest_tag(path) if LATEST in names and not found else None
    if tag is not None and "/" not in tag and tag not in ("", ".", "..") and is_real_dir(path / tag):
        found = [f"{tag}/{n}" for n in sorted(n for n in _names(path / tag) if _DEEPSPEED.fullmatch(n))]
    if found:
        return (
            f"{path} is a DeepSpeed checkpoint (it has `{found[0]}`), not a shardwise one: `engine.load_checkpoint` "
            "and `shardwise checkpoint consolidate` read it (pass the directory holding `latest`, or one tag "
            "directory), `inspect` does not"
        )
    if INDEX in names and not any(re.fullmatch(r"rank\d+\.json", n) for n in names):
        return (
            f"{path} is a plain `torch.distributed.checkpoint` directory (`.metadata` but no `shardwise.json`), "
            "not a shardwise checkpoint: read it with `torch.distributed.checkpoint.load` into your model's "
            "`state_dict` before `shardwise.initialize`"
        )
    if "config.json" in names and names & {"pytorch_model.bin", "model.safetensors", "model.safetensors.index.json"}:
        return (
            f"{path} is a Hugging Face model directory, not a shardwise checkpoint: build the model with "
            "`from_pretrained` and pass it to `shardwise.initialize`"
        )
    return None


def _names(path: Path) -> set[str]:
    try:
        return set(os.listdir(path))
    except OSError:
        return set()


def is_deepspeed_tag_dir(path: Path) -> bool:
    """``path`` is one DeepSpeed checkpoint (a tag directory) and no shardwise one."""
    if not is_real_dir(path) or (path / MANIFEST).exists():
        return False
    return (path / MODEL_STATES).is_file() or (path / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file()


def _latest_tag(load_dir: Path) -> Optional[str]:
    if not is_real_dir(load_dir):
        return None
    try:
        return read_limited(load_dir / LATEST, MAX_LATEST_BYTES).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError, CheckpointError):
        return None


def find_deepspeed(load_dir: Path, tag: Optional[str]) -> Optional[Path]:
    """The DeepSpeed tag directory that ``load_dir`` (and ``tag``, else its ``latest``) names; None for anything
    else (a bad tag included), which the shardwise load then explains."""
    if tag is None and is_deepspeed_tag_dir(load_dir):
        return load_dir
    tag = tag if tag is not None else _latest_tag(load_dir)
    if tag is None or "/" in tag or "\\" in tag or tag in ("", ".", "..") or len(tag) > MAX_TAG_LENGTH:
        return None
    inner = load_dir / tag
    return inner if is_deepspeed_tag_dir(inner) else None
