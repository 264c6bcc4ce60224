"""Checks of DCP's ``.metadata`` index on its own, before anything is read through it.

The index says, for every tensor, its size and dtype, which chunks of it were
saved, and where each chunk's record lies (file, offset, length).  A crafted
index could make a load read another directory's files, allocate far more
than the checkpoint holds, or leave parts of a tensor unwritten (process heap
in the output).  So, before DCP sees it:

* every data file is a bare ``__R_N.distcp`` name inside the checkpoint;
* records do not overlap, and each holds at least its chunk's bytes, so the
  elements the index claims never exceed the bytes on disk;
* every tensor's chunks cover it exactly once;
* no record needs a stream transform (decompression), which could expand a
  small file into gigabytes; shardwise never writes one.

All of it is O(number of chunks): the data itself is never read here.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, NoReturn, Optional

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .encoded import TENSOR_DTYPES, is_count
from .errors import CheckpointError
from .limits import MAX_DIMS

__all__ = ["DATA_FILE", "HINT", "check_index", "record_ends"]

DATA_FILE = re.compile(r"__[0-9]{1,7}_[0-9]{1,7}\.distcp")
HINT = "the checkpoint is damaged or was edited: load a checkpoint you trust, or save it again"
_MISSING = object()


def _fail(file: Path, field: str, problem: str) -> NoReturn:
    raise CheckpointError(f"{file}: `{field}` {problem}; {HINT}")


def _attr(obj: Any, name: str, kind: Any, file: Path, field: str) -> Any:
    value = getattr(obj, name, _MISSING)
    if not isinstance(value, kind):
        found = "missing" if value is _MISSING else f"a {type(value).__name__}"
        _fail(file, f"{field}.{name}", f"is {found}, expected {getattr(kind, '__name__', kind)}")
    return value


def _size(value: Any, file: Path, field: str, dims: Optional[int] = None) -> tuple[int, ...]:
    if not isinstance(value, torch.Size) or len(value) > MAX_DIMS or not all(is_count(n) for n in value):
        _fail(file, field, f"is {value!r:.80}, expected a size of at most {MAX_DIMS} non-negative ints")
    if dims is not None and len(value) != dims:
        _fail(file, field, f"has {len(value)} dimensions, the tensor {dims}")
    return tuple(value)


def check_index(metadata: Any, file: Path) -> Metadata:
    """``metadata`` (an unpickled ``.metadata`` file) if it is safe to read through; raises otherwise."""
    if not isinstance(metadata, Metadata):
        _fail(file, "index", f"is a {type(metadata).__name__}, expected a DCP `Metadata`")
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is not None and not isinstance(storage_meta, StorageMeta):
        _fail(file, "storage_meta", f"is a {type(storage_meta).__name__}")
    storage = _attr(metadata, "storage_data", dict, file, "index")
    record_ends(storage, file)
    tensors = _attr(metadata, "state_dict_metadata", dict, file, "index")
    for fqn, entry in tensors.items():
        if not isinstance(fqn, str):
            _fail(file, "state_dict_metadata", f"has a key of type {type(fqn).__name__}")
        _check_tensor(fqn, entry, storage, file)
    return metadata


def _check_tensor(fqn: str, entry: Any, storage: dict[Any, Any], file: Path) -> None:
    if isinstance(entry, BytesStorageMetadata):
        raise CheckpointError(
            f"{file}: `{fqn}` is a pickled object, which shardwise never writes and never reads from tensor files; "
            f"{HINT}"
        )
    if not isinstance(entry, TensorStorageMetadata):
        _fail(file, fqn, f"is a {type(entry).__name__}, expected tensor metadata")
    properties = _attr(entry, "properties", TensorProperties, file, fqn)
    dtype = getattr(properties, "dtype", None)
    if not isinstance(dtype, torch.dtype) or dtype not in TENSOR_DTYPES.values():
        _fail(file, f"{fqn}.dtype", f"is {dtype!r:.40}, not a tensor dtype shardwise stores")
    size = _size(getattr(entry, "size", None), file, f"{fqn}.size")
    chunks = _attr(entry, "chunks", list, file, fqn)
    spans = []
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, ChunkStorageMetadata):
            _fail(file, f"{fqn}.chunks[{i}]", f"is a {type(chunk).__name__}")
        offsets = _size(getattr(chunk, "offsets", None), file, f"{fqn}.chunks[{i}].offsets", len(size))
        sizes = _size(getattr(chunk, "sizes", None), file, f"{fqn}.chunks[{i}].sizes", len(size))
        spans.append((offsets, sizes))
        _check_record(fqn, offsets, math.prod(sizes) * dtype.itemsize, storage, file)
    _check_cover(fqn, size, spans, file)


def _check_cover(fqn: str, size: tuple[int, ...], spans: list[tuple[tuple[int, ...], tuple[int, ...]]], file: Path) -> None:
    """Chunks cover every element exactly once.

    shardwise writes 1-D tensors (flattened masters, per-element optimizer
    state) as any set of ranges, everything else as one whole chunk.
    """
    if len(size) != 1:
        if len(spans) != 1 or any(spans[0][0]) or spans[0][1] != size:
            _fail(file, f"{fqn}.chunks", f"are {spans!r:.120}, expected one chunk covering the whole size {size}")
        return
    end = 0
    for (start,), (length,) in sorted(spans):
        if start != end:
            what = "overlap" if start < end else "leave a gap"
            _fail(file, f"{fqn}.chunks", f"{what} at element {min(start, end)} of {size[0]}; each element must be saved once")
        end = start + length
    if end != size[0]:
        _fail(file, f"{fqn}.chunks", f"cover elements [0, {end}) of {size[0]}")


def _check_record(fqn: str, offsets: tuple[int, ...], nbytes: int, storage: dict[Any, Any], file: Path) -> None:
    info = storage.get(MetadataIndex(fqn, offsets))
    if info is None:
        _fail(file, f"{fqn}.chunks", f"include offset {offsets} with no storage record")
    if info.length < nbytes:
        _fail(file, f"storage_data[{fqn}@{offsets}].length", f"is {info.length} bytes, less than the {nbytes} its chunk holds")


def record_ends(storage: dict[Any, Any], file: Path) -> dict[str, int]:
    """``{data file: bytes it must have}``; raises unless every record is a bare data-file name and
    records do not overlap (so no two chunks share bytes)."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for key, info in storage.items():
        where = f"storage_data[{getattr(key, 'fqn', key)!r:.80}]"
        if not isinstance(key, MetadataIndex):
            _fail(file, where, f"has a key of type {type(key).__name__}")
        path = getattr(info, "relative_path", None)
        if not isinstance(path, str) or not DATA_FILE.fullmatch(path):
            _fail(file, f"{where}.relative_path", f"is {path!r:.80}, expected a file name `__R_N.distcp` inside the checkpoint")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int) and is_count(offset) and is_count(length)):
            _fail(file, where, f"has offset {offset!r:.40} and length {length!r:.40}, expected non-negative ints")
        if getattr(info, "transform_descriptors", None):
            _fail(file, f"{where}.transform_descriptors", "name stream transforms, which shardwise never writes")
        ranges.setdefault(path, []).append((offset, offset + length))
    ends = {}
    for path, spans in ranges.items():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            if start < end:
                _fail(file, f"storage_data ({path})", f"has records that overlap at byte {start}")
        ends[path] = spans[-1][1]
    return ends
