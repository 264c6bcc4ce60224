"""Full weights from a sharded checkpoint in one CPU process, with no process group.

:func:`consolidated_state_dict` returns the model's full fp32 ``state_dict``, as ``engine.full_state_dict()``
would have at save time: tied names share one tensor.  safetensors refuses shared tensors, so a
``.safetensors`` file stores each once and names the others in its metadata (``shardwise_aliases``);
:func:`load_consolidated` puts them back, for either format.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import textwrap
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file

from ..model_io.export import ALIASES_KEY, KEYS_KEY, save_state_dict, tied_aliases
from . import layout
from .codec import Decoder, empty_tensors, refuse_pickles
from .deepspeed_format import read_deepspeed
from .files import CheckpointError, check_views, record_is_stored
from .stateful import ModelState, TensorState
from .storage import LoadPlanner, SafeReader, dcp_errors
from .validate import check_complete

__all__ = ["consolidate", "consolidated_client_state", "consolidated_state_dict", "describe", "load_consolidated"]


def _read(path: Path, manifest: dict[str, Any], name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Fill ``tensors`` (the Stateful ``name``'s) from the checkpoint in ``path``, in this process alone."""
    with warnings.catch_warnings(), dcp_errors(path):
        warnings.simplefilter("ignore")  # DCP warns that no process group exists: that is the point here
        reader = SafeReader(path, manifest)
        dcp.load({name: TensorState(tensors)}, storage_reader=reader, planner=LoadPlanner(), no_dist=True)

def _checkpoint(ckpt_dir: Any, tag: Optional[str], engine: Optional[str]) -> tuple[Path, dict[str, Any]]:
    path = layout.resolve(ckpt_dir, tag)
    if engine is None and (path / layout.GROUP_MANIFEST).is_file():
        names = layout.read_group(path)
        engine = names[0] if len(names) == 1 else None  # the one engine there needs no name
    path = layout.member_path(path, engine)
    return path, check_complete(path)


def consolidated_state_dict(ckpt_dir: Any, tag: Optional[str] = None, engine: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The full fp32 ``state_dict`` saved in ``ckpt_dir`` (a save directory, or one checkpoint); in a
    checkpoint of several engines, that of ``engine``.  A DeepSpeed checkpoint directory is read as
    DeepSpeed's ``zero_to_fp32.py`` reads it (see ``deepspeed_format.py``)."""
    deepspeed = layout.find_deepspeed(Path(ckpt_dir), tag)
    if deepspeed is not None:
        return read_deepspeed(deepspeed).weights()
    path, manifest = _checkpoint(ckpt_dir, tag, engine)
    # sizes were checked against the index and the disk, and chunks cover each tensor once: every element is read
    model, state_dict = ModelState.whole(manifest)
    _read(path, manifest, "model", model.tensors)
    full = {id(v): v.float() if v.is_floating_point() else v for v in state_dict.values()}  # fp32; tied stay one
    return {key: full[id(value)] for key, value in state_dict.items()}


def consolidated_client_state(ckpt_dir: Any, tag: Optional[str] = None, engine: Optional[str] = None, *,
                              allow_pickle: bool = False) -> dict[str, Any]:
    """The ``client_state`` saved in ``ckpt_dir`` (what ``load_checkpoint`` returns second), read in one CPU
    process with no process group, tensors included.  An entry that needed pickle is refused unless
    ``allow_pickle`` (unpickling can run code from the checkpoint)."""
    path, manifest = _checkpoint(ckpt_dir, tag, engine)
    encoded = manifest["client_state"]
    refuse_pickles(encoded, "client_state", allow_pickle)
    tensors = empty_tensors(encoded)
    if tensors:
        _read(path, manifest, "extra", tensors)
    state = Decoder(tensors, allow_pickle).decode(encoded, "client_state")
    return state if isinstance(state, dict) else {}


def consolidate(ckpt_dir: Any, out: Any, tag: Optional[str] = None, engine: Optional[str] = None) -> dict[str, Any]:
    """Write the full weights of a checkpoint to ``out`` (``.safetensors`` or ``.pt``); returns a summary.

    In a checkpoint of several engines, ``engine`` names the one to export.
    """
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in (".safetensors", ".pt", ".pth", ".bin"):
        raise CheckpointError(f"output file {out} has suffix `{suffix}`; use `.safetensors` or `.pt`")
    state = consolidated_state_dict(ckpt_dir, tag, engine)
    aliases = tied_aliases(state)
    save_state_dict(state, out)
    distinct = [v for k, v in state.items() if k not in aliases]
    return {"file": str(out), "tensors": len(distinct), "elements": sum(v.numel() for v in distinct),
            "bytes": os.path.getsize(out), "aliases": aliases}


def load_consolidated(path: Any) -> dict[str, torch.Tensor]:
    """A file written by :func:`consolidate`, as a ``state_dict`` (tied names share one tensor)."""
    path = Path(path)
    if path.suffix.lower() != ".safetensors":
        with open(path, "rb") as stream:  # a deflated file could expand far beyond its size: refuse it
            if stream.read(4) == b"PK\x03\x04":
                record_is_stored(stream, 0, os.fstat(stream.fileno()).st_size, str(path))
        state: dict[str, torch.Tensor] = torch.load(path, map_location="cpu", weights_only=True)
        check_views(state, path)  # a stride-0 view would cost its full size in the first copy
        return state
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    tensors = load_file(str(path))
    try:
        aliases = json.loads(metadata.get(ALIASES_KEY, "{}"))
        keys = json.loads(metadata.get(KEYS_KEY, "null")) or [*tensors, *aliases]
        return {key: tensors[aliases.get(key, key)] for key in keys}
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CheckpointError(
            f"{path}: its metadata `{ALIASES_KEY}` / `{KEYS_KEY}` does not match its tensors ({type(exc).__name__}: "
            f"{exc!s:.100}); it was not written by `consolidate` or was edited: load it with `safetensors.torch.load_file`"
        ) from None


def describe(save_dir: Any) -> str:
    """A human-readable summary of every checkpoint in ``save_dir`` (or of one checkpoint directory)."""
    root = Path(save_dir)
    latest: Optional[str] = root.name
    if (root / layout.MANIFEST).is_file():
        entries = [(root.name, root, True)]
    else:
        entries = layout.list_checkpoints(root)
        latest = None
        with contextlib.suppress(FileNotFoundError, CheckpointError):  # a bad `latest` marks none; loading says why
            latest = layout.read_latest(root)
        if not entries:
            raise CheckpointError(layout.foreign_format(root) or f"no checkpoints in {root}")
    return "\n".join([f"{root}:", *(_describe_one(name, path, done, name == latest) for name, path, done in entries)])


def _describe_one(name: str, path: Path, committed: bool, is_latest: bool) -> str:
    size = sum(f.lstat().st_size for f in path.iterdir() if not f.is_symlink() and f.is_file())
    mark = "  (latest)" if is_latest else ""
    if not committed:
        return f"  {name}: INCOMPLETE (a save that did not finish; never loaded), {_mb(size)} on disk"
    if (path / layout.GROUP_MANIFEST).is_file():
        try:
            members = layout.read_group(path)
        except CheckpointError as exc:
            return f"  {name}{mark}: BROKEN: {exc}"
        lines = [f"  {name}{mark}: {len(members)} engines"]
        lines += [textwrap.indent(_describe_one(member, path / member, True, False), "  ") for member in members]
        return "\n".join(lines)
    try:
        manifest = check_complete(path)
    except CheckpointError as exc:
        return f"  {name}{mark}: BROKEN: {exc}"
    params = manifest["params"]
    elements = sum(math.prod(p["shape"]) for p in params.values())
    frozen = sum(math.prod(m["shape"]) for m in manifest["module"].values())
    optimizer = manifest.get("optimizer") or {}
    keys = sorted({k for entries in optimizer.get("state", {}).values() for k in entries})
    return (
        f"  {name}{mark}: world size {manifest['world_size']}, ZeRO stage {manifest['stage']}, "
        f"dtype {manifest['dtype']}, global step {manifest['counters']['global_steps']}\n"
        f"    {len(params)} trainable tensors ({elements:,} elements, fp32 masters), "
        f"{len(manifest['module'])} other entries ({frozen:,} elements), {len(manifest['aliases'])} tied alias(es)\n"
        f"    optimizer {optimizer.get('class', 'none')} state {keys}; {_mb(size)} on disk"
    )


def _mb(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"
