"""Editing a real checkpoint as an attacker would, and measuring what loading it costs.

Shared by ``test_checkpoint_security.py`` and ``test_checkpoint_fuzz.py``.
The index is edited with plain ``pickle`` (the test trusts itself), then read
back by shardwise through its restricted unpickler and checks.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch
from _checkpoint_common import build, tied_model, train

from shardwise.checkpoint.files import digest

TAG = "step2"
CLIENT_STATE = {"epoch": 3, "t": torch.arange(4.0), "nested": {"a": (1, 2)}}


def save_base(root: str, seed: int = 0) -> None:
    """(every rank) A real 2-step checkpoint of TiedNet at stage 2: aliases, a buffer, Adam state, a client tensor."""
    engine = build(2, seed=seed, model=tied_model(seed))
    train(engine, 0, 2)
    engine.save_checkpoint(root, tag=TAG, client_state=CLIENT_STATE)
    engine.destroy()


def copy_save_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def rehash(ckpt: Path) -> None:
    """Record the edited files' new checksums in the manifest, as an attacker editing the other files would
    (so the checks behind the checksums are what refuses the edit; `test_faults_checkpoint.py` tests the
    checksums, `test_faults_manifest.py` a manifest that lost them)."""
    manifest = ckpt / "shardwise.json"
    data = json.loads(manifest.read_text())
    data["files"] = {name: digest(ckpt / name) for name in data["files"] if (ckpt / name).is_file()}
    manifest.write_text(json.dumps(data))


def edit_json(path: Path, fn: Callable[[Any], Any]) -> None:
    data = json.loads(path.read_text())
    result = fn(data)
    path.write_text(json.dumps(data if result is None else result))
    if path.name != "shardwise.json":
        rehash(path.parent)


def edit_manifest(ckpt: Path, fn: Callable[[Any], Any]) -> None:
    edit_json(ckpt / "shardwise.json", fn)


def read_index(ckpt: Path) -> Any:
    return pickle.loads((ckpt / ".metadata").read_bytes())


def write_index(ckpt: Path, metadata: Any) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    rehash(ckpt)


def edit_index(ckpt: Path, fn: Callable[[Any], Any]) -> None:
    metadata = read_index(ckpt)
    fn(metadata)
    write_index(ckpt, metadata)


def storage_of(metadata: Any, fqn: str) -> list[tuple[Any, Any]]:
    """``(MetadataIndex, _StorageInfo)`` of every saved chunk of ``fqn``."""
    return [(k, v) for k, v in metadata.storage_data.items() if k.fqn == fqn]


def deflated_record(ckpt: Path, fqn: str, expand_to: int) -> None:
    """Append to the data file a deflated copy of ``fqn``'s first record whose tensor data
    decompresses to ``expand_to`` bytes (of zeros), and point the index at it."""
    metadata = read_index(ckpt)
    _, info = storage_of(metadata, fqn)[0]
    data_file = ckpt / info.relative_path
    with open(data_file, "rb") as handle:
        handle.seek(info.offset)
        original = zipfile.ZipFile(io.BytesIO(handle.read(info.length)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for entry in original.infolist():
            if re.search(r"/data/\d+$", entry.filename):
                _write_zeros(archive, entry.filename, expand_to)
            else:
                archive.writestr(entry.filename, original.read(entry.filename))
    record = out.getvalue()
    offset = data_file.stat().st_size
    with open(data_file, "ab") as handle:
        handle.write(record)
    info.offset, info.length = offset, len(record)
    write_index(ckpt, metadata)


def _write_zeros(archive: zipfile.ZipFile, name: str, size: int) -> None:
    block = bytes(2**20)
    with archive.open(name, "w", force_zip64=True) as entry:
        for _ in range(size // len(block)):
            entry.write(block)


# ------------------------------------------------------------ memory


def _status(field: str) -> int:
    match = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(match.group(1)) if match else 0


def reset_peak() -> None:
    """Make the peak RSS (``VmHWM``) restart from the current RSS (Linux; a no-op where refused)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_growth_mb(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``(fn()'s result or the exception it raised, peak RSS growth in MB while it ran)``.

    Without a peak reset the growth is over-counted, never under-counted.
    """
    reset_peak()
    before = _status("VmRSS")
    try:
        result: Any = fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - the caller checks which (DCP's own error is a BaseException)
        result = exc
    return result, (_status("VmHWM") - before) / 1024
