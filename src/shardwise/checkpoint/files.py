"""The bottom layer: the checkpoint error, the bounds on what a checkpoint may ask, and reading its files.

A checkpoint may come from someone else (``docs/checkpoints.md``, "Threat model", which lists what each check here
refuses and the limits): each small file is opened with ``O_NOFOLLOW`` and ``O_NONBLOCK`` (a planted symlink or FIFO);
``torch.load`` allocates each storage at the size its record declares and inflates a deflated record in full, so every
record must be stored and within budget, and no tensor may cover more elements than its storage.

Checksums: the manifest lists every file with its size and SHA-256, and each is checked before it is parsed or read;
a file the manifest does not list is refused, so no path skips a check.  SHA-256 runs at about 1 GB/s on one core:
one more pass over the bytes a rank reads, from the page cache, right before DCP reads them.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import stat
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Iterable, NoReturn, Optional

import torch

__all__ = [
    "HINT", "MAX_DEPTH", "MAX_DIMS", "MAX_INDEX_BYTES", "MAX_LATEST_BYTES", "MAX_MANIFEST_BYTES", "MAX_RANK_FILE_BYTES",
    "MAX_STORE_VALUE_BYTES", "MAX_TAG_LENGTH", "MAX_WORLD_SIZE", "CheckpointError", "StoreValueError", "check_records",
    "check_views", "digest", "expected_digests", "fail", "is_real_dir", "open_regular", "read_json", "read_limited", "record_is_stored",
    "regular_size", "require_listed", "verify",
]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says why and what to do."""


class StoreValueError(CheckpointError):
    """A value in the rendezvous store that the checkpoint agreement reads is not what a rank of it wrote:
    not JSON, above the size bound, or holding a type outside the allow-list (see ``store_codec.py``)."""


#: the fix for a checkpoint whose files or index fail a check
HINT = "the checkpoint is damaged or was edited: load a checkpoint you trust, or save it again"

MAX_LATEST_BYTES = 4096  # `latest` holds one tag
MAX_TAG_LENGTH = 255  # a tag names one directory entry (the usual file-name limit)
#: ``shardwise.json``: about 300 bytes per tensor, so room for ~800k tensors and a large ``client_state``
MAX_MANIFEST_BYTES = 256 * 2**20
#: ``rankR.json``: one rank's RNG states (a few KB; more with many CUDA devices)
MAX_RANK_FILE_BYTES = 16 * 2**20
MAX_INDEX_BYTES = 256 * 2**20  # `.metadata`: DCP's index, about 200 bytes per tensor chunk
#: one value the checkpoint agreement reads from the rendezvous store: the largest is rank 0's global save plan,
#: JSON of about 450-500 bytes per tensor chunk of every rank (measured on a stage-2 save): room for ~500k chunks
MAX_STORE_VALUE_BYTES = 256 * 2**20
MAX_WORLD_SIZE = 2**20  # ranks a manifest may claim (each is a file to look for)
MAX_DIMS = 64  # dimensions of one tensor
MAX_DEPTH = 100  # nesting of JSON-encoded values (`client_state`, scheduler state...)

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def fail(file: Path, field: str, problem: str) -> NoReturn:
    """Refuse ``file``, whose ``field`` has ``problem``."""
    raise CheckpointError(f"{file}: `{field}` {problem}; {HINT}")


def _not_regular(path: Path, mode: int) -> CheckpointError:
    kind = "a symbolic link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"
    return CheckpointError(
        f"{path} is {kind}; a checkpoint's files must be regular files inside its directory (links are never "
        "followed, so a checkpoint cannot make shardwise read another file): replace it with the real file"
    )


def open_regular(path: Path) -> BinaryIO:
    """Regular file ``path`` opened for reading, never through a link (nor a FIFO, which would block);
    FileNotFoundError if it does not exist, :class:`CheckpointError` if it is anything else."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _not_regular(path, stat.S_IFLNK) from None
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    handle = os.fdopen(fd, "rb")
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        handle.close()
        raise _not_regular(path, mode)
    return handle


def read_limited(path: Path, limit: int) -> bytes:
    """The bytes of regular file ``path`` (as :func:`open_regular` opens it), at most ``limit`` of them."""
    with open_regular(path) as handle:
        info = os.fstat(handle.fileno())
        if info.st_size > limit:
            raise CheckpointError(
                f"{path} is {info.st_size:,} bytes, more than the {limit:,} such a file can need; it is not a file "
                "that shardwise wrote (or was replaced): load a checkpoint you trust"
            )
        data = handle.read(limit + 1)
    if len(data) > limit:  # grew while we read it
        raise CheckpointError(f"{path} is larger than the {limit:,} bytes such a file can need")
    return data


def read_json(path: Path, limit: int = MAX_MANIFEST_BYTES) -> Any:
    """The JSON value in ``path``, read as :func:`read_limited` does."""
    data = read_limited(path, limit)
    try:
        return json.loads(data)
    except RecursionError:
        raise CheckpointError(f"{path} nests its values too deeply to be a file shardwise wrote") from None
    except ValueError as exc:  # also UnicodeDecodeError
        raise CheckpointError(f"{path} is not valid JSON ({exc}); the file is damaged") from None


def regular_size(path: Path) -> int | None:
    """The size of regular file ``path`` (None if absent); a link or anything else is refused."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode):
        raise _not_regular(path, info.st_mode)
    return info.st_size


def is_real_dir(path: Path) -> bool:
    """``path`` is a directory and not a symbolic link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


# ------------------------------------------------------------ torch.save files


def check_records(stream: BinaryIO, path: Path, budget: Optional[int], over_budget: str) -> None:
    """Raise unless ``stream``'s zip records are stored, do not overlap, and sum to at most ``budget`` bytes
    (``over_budget`` ends that error: what the budget is, the fix)."""
    size = os.fstat(stream.fileno()).st_size
    try:
        entries = zipfile.ZipFile(stream).infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise CheckpointError(f"{path} is not a `torch.save` file ({exc}); it is damaged or was replaced") from None
    finally:
        stream.seek(0)
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(
                f"{path} holds `{entry.filename}` compressed ({entry.compress_size:,} bytes that expand to "
                f"{entry.file_size:,}); `torch.save` never compresses, and shardwise refuses to expand a record "
                "it cannot bound: the file was re-packed or crafted; load the file as it was saved"
            )
    total = sum(entry.file_size for entry in entries)
    if total > size:
        raise CheckpointError(
            f"{path}: its zip records claim {total:,} bytes in a file of {size:,}, so they overlap (one "
            "record's bytes read many times over); `torch.save` never writes that: the file was crafted"
        )
    if budget is not None and total > budget:
        raise CheckpointError(f"{path} holds {total:,} bytes of records, more than {over_budget}")


def record_is_stored(stream: Any, offset: int, length: int, where: str) -> None:
    """Raise unless the ``torch.save`` record at ``[offset, offset + length)`` is an uncompressed zip
    (reading only its central directory)."""
    try:
        with zipfile.ZipFile(_Window(stream, offset, length)) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise CheckpointError(f"{where} is not a tensor record ({exc}); {HINT}") from None
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED or entry.file_size > length:
            raise CheckpointError(
                f"{where} holds `{entry.filename}` compressed ({entry.compress_size:,} -> {entry.file_size:,} bytes); "
                f"shardwise writes tensor records uncompressed and refuses to expand them; {HINT}"
            )


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of ``stream``, as a seekable file of their own."""

    def __init__(self, stream: Any, offset: int, length: int) -> None:
        super().__init__()
        self.stream, self.offset, self.length, self.position = stream, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = min(max(base + offset, 0), self.length)
        return self.position

    def readinto(self, buffer: Any) -> int:
        self.stream.seek(self.offset + self.position)
        data = self.stream.read(min(len(buffer), self.length - self.position))
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)


def check_views(value: Any, path: Path) -> None:
    """Raise if a tensor anywhere in ``value`` (dicts, lists, tuples) covers more elements than its storage."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, torch.Tensor):
            _check_view(item, where, path)
        elif isinstance(item, dict):
            stack.extend((v, f"{where}[{k!r:.40}]") for k, v in item.items())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
        elif hasattr(item, "fields") and isinstance(item.fields, dict):  # a DeepSpeedRecord's fields
            stack.append((item.fields, where))


def _check_view(tensor: torch.Tensor, where: str, path: Path) -> None:
    if tensor.dim() > MAX_DIMS:
        raise CheckpointError(f"{path}: the tensor at `{where}` has {tensor.dim()} dimensions, more than the "
                              f"{MAX_DIMS} any model's tensor has; the file was crafted")
    needed = tensor.numel() * tensor.element_size()
    held = tensor.untyped_storage().nbytes()
    if needed > held:
        raise CheckpointError(
            f"{path}: the tensor at `{where}` is {tuple(tensor.shape)} ({tensor.numel():,} elements, {needed:,} "
            f"bytes once copied) over a storage of {held:,} bytes, with strides {tensor.stride()}: elements share "
            "bytes (a stride-0 view), which `torch.save` of a model's or optimizer's tensor never writes; the file "
            "was crafted or damaged: load the checkpoint as it was saved"
        )

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


def expected_digests(manifest: Any, file: Path) -> dict[str, dict[str, Any]]:
    """The ``files`` entry of the manifest ``manifest`` read from ``file``, checked to be well formed."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if files is None:
        raise CheckpointError(
            f"{file} has no `files` entry (each file of the checkpoint with its size and SHA-256), so no file of "
            f"{file.parent} can be checked; the manifest was damaged or edited. Restore it from a good copy, or "
            "load another checkpoint"
        )
    good = isinstance(files, dict) and all(
        isinstance(name, str) and isinstance(entry, dict) and type(entry.get("bytes")) is int
        and isinstance(entry.get("sha256"), str) and _HEX.fullmatch(entry["sha256"]) is not None
        for name, entry in files.items())
    if not good:
        raise CheckpointError(f"{file}: the `files` entry is not a map of file name -> {{bytes, sha256}}; the "
                              "manifest is damaged or was edited by hand")
    return files


def require_listed(root: Path, names: Iterable[str], expected: dict[str, dict[str, Any]]) -> None:
    """Raise naming the first of ``names`` (files in ``root`` a load reads) that the manifest does not list."""
    for name in names:
        if name not in expected:
            raise CheckpointError(
                f"{root / name} is not among the files the manifest of {root} lists with checksums, so it cannot be "
                "checked; the manifest was edited, or the checkpoint was assembled from pieces of different saves. "
                "Load a checkpoint as it was written"
            )


def verify(root: Path, name: str, expected: dict[str, dict[str, Any]]) -> None:
    """Raise unless ``root / name`` has the size and SHA-256 the manifest recorded (``expected``: its ``files``)."""
    require_listed(root, [name], expected)
    want = expected[name]
    got = digest(root / name)
    if got != {"bytes": want["bytes"], "sha256": want["sha256"]}:
        what = (f"{got['bytes']:,} bytes where the save wrote {want['bytes']:,}" if got["bytes"] != want["bytes"]
                else f"SHA-256 {got['sha256'][:16]}... where the save recorded {want['sha256'][:16]}...")
        raise CheckpointError(
            f"checkpoint file {root / name} is corrupted: {what}; it changed after the save finished (a disk, "
            "copy or transfer error, or an edit). Restore it from a good copy, or load another checkpoint"
        )
