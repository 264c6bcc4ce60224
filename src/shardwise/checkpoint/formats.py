"""Recognising checkpoints of other kinds, so a load says what it was given and what to do.

Without this, a DeepSpeed directory or a plain ``torch.distributed.checkpoint``
one looks like a shardwise save that never finished ("a rank crashed..."),
and a ``torch.save`` file like a directory that does not exist.  Detection
looks only at names and a few magic bytes, never at the data.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Optional

from .errors import CheckpointError
from .files import is_real_dir, read_limited
from .limits import MAX_LATEST_BYTES

__all__ = ["foreign_format"]

_DEEPSPEED = re.compile(
    r"(mp_rank_\d+_model_states\.pt|(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_(optim|model)_states\.pt"
    r"|layer_\d+-model_\d+-model_states\.pt|zero_to_fp32\.py)"
)
_LOAD_WEIGHTS = (
    "`model.load_state_dict(torch.load(FILE, weights_only=True))` before `shardwise.initialize`"
)


def foreign_format(path: Path) -> Optional[str]:
    """What ``path`` is, as a sentence with the fix, when it is a checkpoint shardwise does not read; else None."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return _file_format(path)
    if not stat.S_ISDIR(mode):
        return None
    names = _names(path)
    if "shardwise.json" in names:
        return None
    deepspeed = _deepspeed_file(path, names)
    if deepspeed is not None:
        return (
            f"{path} is a DeepSpeed checkpoint (it has `{deepspeed}`), not a shardwise one: `engine.load_checkpoint` "
            "and `shardwise checkpoint consolidate` read it (pass the directory holding `latest`, or one tag "
            "directory), `inspect` does not"
        )
    if ".metadata" in names and not any(re.fullmatch(r"rank\d+\.json", n) for n in names):
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


def _deepspeed_file(path: Path, names: set[str]) -> Optional[str]:
    found = sorted(n for n in names if _DEEPSPEED.fullmatch(n))
    if found:
        return found[0]
    if "latest" not in names:
        return None
    try:
        tag = read_limited(path / "latest", MAX_LATEST_BYTES).decode("utf-8").strip()
    except (OSError, CheckpointError, UnicodeDecodeError):
        return None
    inner = path / tag
    if "/" in tag or tag in ("", ".", "..") or not is_real_dir(inner):
        return None
    found = sorted(n for n in _names(inner) if _DEEPSPEED.fullmatch(n))
    return f"{tag}/{found[0]}" if found else None


def _file_format(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            head = handle.read(16)
    except OSError:
        head = b""
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        kind = "a single file saved with `torch.save`"
        fix = f"load it with {_LOAD_WEIGHTS}"
    elif len(head) >= 9 and head[8:9] == b"{":
        kind = "a safetensors file"
        fix = "load it with `shardwise.checkpoint.load_consolidated(FILE)` (or `safetensors.torch.load_file`) and `model.load_state_dict`"
    else:
        kind = "a file"
        fix = "pass the `save_dir` given to `save_checkpoint`, or one checkpoint directory in it"
    return f"{path} is {kind}, not a shardwise checkpoint directory: {fix}"
