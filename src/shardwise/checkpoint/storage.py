"""``torch.distributed.checkpoint`` (DCP) as the storage and resharding layer, and its index read safely.

DCP stores each tensor as chunks and, on load, reads the overlap of the chunks saved with those each rank asks
for: resharding, provided a rank can say "elements ``[start, end)`` of this flattened parameter".  DTensor
cannot (its uneven shards follow a fixed rule) and ShardedTensor needs a collective, so :class:`FlatChunks`
(any 1-D pieces of a 1-D tensor) and two planners that understand it are here.  Replicated pieces are written
once: DCP drops chunks with the same index.

The ``.metadata`` index is unpickled building only DCP's metadata classes, then checked (:func:`check_index`, by the
rules of ``docs/checkpoints.md``, "Threat model") before DCP plans with it.  DCP wraps every error in
``CheckpointException`` (a ``BaseException``); :func:`dcp_errors` makes it a :class:`CheckpointError`.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from . import files
from .codec import TENSOR_DTYPES, is_count
from .files import HINT, MAX_DIMS, MAX_INDEX_BYTES, CheckpointError, fail, read_limited, record_is_stored, regular_size
from .layout import INDEX, MANIFEST

__all__ = [
    "FlatChunks", "LoadPlanner", "SafeReader", "SavePlanner", "check_index", "dcp_errors", "flatten",
    "read_metadata", "record_ends",
]

_DATA_FILE = re.compile(r"__[0-9]{1,7}_[0-9]{1,7}\.distcp")
_MISSING = object()


@dataclass
class FlatChunks:
    """Pieces ``(offset, 1-D tensor)`` of a 1-D tensor of ``numel`` elements (this rank's part)."""

    numel: int
    pieces: list[tuple[int, torch.Tensor]]

    def size(self) -> torch.Size:
        return torch.Size([self.numel])

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size([o]), torch.Size([t.numel()])) for o, t in self.pieces]

    def piece_at(self, offset: int) -> torch.Tensor:
        for start, tensor in self.pieces:
            if start == offset:
                return tensor
        raise CheckpointError(f"internal: no local piece at offset {offset} (pieces at {[o for o, _ in self.pieces]})")


def flatten(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``{"model": {"master/x": ...}}`` -> ``{"model/master/x": ...}`` (one level, as the Stateful objects return)."""
    flat: dict[str, Any] = {}
    for top, inner in state_dict.items():
        if not isinstance(inner, dict):
            raise CheckpointError(f"internal: state_dict entry `{top}` is a {type(inner).__name__}, not a dict")
        for key, value in inner.items():
            flat[f"{top}/{key}"] = value
    return flat


def _lookup(state_dict: dict[str, Any], index: MetadataIndex) -> Any:
    obj = state_dict[index.fqn]
    return obj.piece_at((index.offset or torch.Size([0]))[0]) if isinstance(obj, FlatChunks) else obj


def _write_item(fqn: str, tensor: torch.Tensor, offsets: torch.Size, size: torch.Size) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=offsets, sizes=tensor.size())
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(tensor), size=size),
    )


class SavePlanner(DefaultSavePlanner):
    """DCP's default planning (dedup, validation) over :class:`FlatChunks` and plain tensors only."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: Any, storage_meta: Optional[StorageMeta] = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(flatten(state_dict), storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, FlatChunks):
                items += [_write_item(fqn, t, torch.Size([o]), obj.size()) for o, t in obj.pieces if t.numel()]
            elif isinstance(obj, torch.Tensor):
                items.append(_write_item(fqn, obj, torch.Size([0] * obj.dim()), obj.size()))
            else:
                raise CheckpointError(f"internal: `{fqn}` is a {type(obj).__name__}; only tensors go to tensor files")
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _lookup(self.state_dict, index)


class LoadPlanner(DefaultLoadPlanner):
    """Reads into :class:`FlatChunks` pieces and plain tensors, resharding as needed; never unpickles."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: Any, metadata: Optional[Metadata] = None, is_coordinator: bool = False) -> None:
        self.original_state_dict = state_dict
        self.state_dict = flatten(state_dict)
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise CheckpointError("internal: DCP gave the load planner no metadata")
        saved = self.metadata.state_dict_metadata
        requests = []
        for fqn, obj in self.state_dict.items():
            md = saved.get(fqn)
            if md is None and obj.size().numel() == 0:
                continue  # nothing to read: an empty tensor writes no chunk, so it has no entry
            if md is None:
                raise CheckpointError(f"the checkpoint's tensor index has no entry `{fqn}`; the checkpoint is damaged")
            if isinstance(md, BytesStorageMetadata):
                raise CheckpointError(
                    f"`{fqn}` in this checkpoint is a pickled object, which shardwise never reads from tensor files"
                )
            if md.size != obj.size():
                raise CheckpointError(f"`{fqn}` has {tuple(md.size)} elements in the checkpoint but {tuple(obj.size())} here")
            wanted = obj.chunks() if isinstance(obj, FlatChunks) else [
                ChunkStorageMetadata(torch.Size([0] * obj.dim()), obj.size())]
            requests += create_read_items_for_chunk_list(fqn, md, wanted)
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise CheckpointError(f"`{read_item.dest_index.fqn}` is a pickled object; shardwise never reads those")


# --------------------------------------------------------------- metadata file

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
        "BytesStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
} | {("pathlib", name) for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata classes, torch dtypes/sizes/layouts and paths."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise CheckpointError(
            f"the checkpoint's `.metadata` file refers to `{module}.{name}`, which a DCP index never needs; "
            "refusing to unpickle it (the file may have been tampered with)"
        )


def read_metadata(path: Path) -> Metadata:
    """DCP's ``.metadata`` index of the checkpoint in ``path``, unpickled safely and checked (:func:`check_index`).
    A load reads it twice (to check the checkpoint, then in DCP): an unchanged file is not read again."""
    file = path / INDEX
    try:
        info = os.lstat(file)
        key: Optional[tuple[Any, ...]] = (str(file), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    except OSError:
        key = None
    if key is not None and _last_index[0] == key:
        return _last_index[1]
    data = read_limited(file, MAX_INDEX_BYTES)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any way a crafted pickle fails is one answer
        raise CheckpointError(f"{file} is not a readable DCP index ({type(exc).__name__}: {exc}); {HINT}") from None
    checked = check_index(metadata, file)
    _last_index[:] = [key, checked]
    return checked


_last_index: list[Any] = [None, None]  # (file identity, its checked index): the one index last read


@contextmanager
def dcp_errors(path: Path) -> Iterator[None]:
    """Run a ``dcp.load`` so that any failure is a :class:`CheckpointError` (the first rank's own, if it was one)."""
    try:
        yield
    except CheckpointException as exc:
        failures = sorted(exc.failures.items())
        for _, (error, _trace) in failures:
            if isinstance(error, CheckpointError):
                raise CheckpointError(str(error)) from None
        detail = "; ".join(f"rank {rank}: {type(error).__name__}: {error}" for rank, (error, _) in failures)
        raise CheckpointError(f"reading the tensors of {path} failed ({detail}); {HINT}") from None


class SafeReader(FileSystemReader):
    """DCP's file reader, with the ``.metadata`` index unpickled by :func:`read_metadata`, and every
    tensor file this rank reads checked against the checksums of the checked ``manifest`` first."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        super().__init__(path)
        self.expected = files.expected_digests(manifest, path / MANIFEST)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path} has no global `.metadata` index; it was not written by shardwise")
        root = Path(self.path)
        metadata = read_metadata(root)
        metadata.storage_meta = metadata.storage_meta if metadata.storage_meta is not None else StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        for name, size in record_ends(metadata.storage_data, root / INDEX).items():
            if (regular_size(root / name) or 0) < size:
                raise CheckpointError(f"{root / name} is missing or shorter than its index says; {HINT}")
        return metadata

    def read_data(self, plan: LoadPlan, planner: Any) -> Any:
        # DCP reads each record straight into the engine's tensors: every record is checked before any is read
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            by_file.setdefault(info.relative_path, []).append(info)
        root = Path(self.path)
        for name, infos in by_file.items():
            files.verify(root, name, self.expected)
            with open(root / name, "rb") as stream:
                for info in sorted(infos, key=lambda i: i.offset):
                    where = f"the tensor record at byte {info.offset} of {root / name}"
                    record_is_stored(stream, info.offset, info.length, where)
        return super().read_data(plan, planner)


# --------------------------------------------------------------- index checks


def _attr(obj: Any, name: str, kind: Any, file: Path, field: str) -> Any:
    value = getattr(obj, name, _MISSING)
    if not isinstance(value, kind):
        found = "missing" if value is _MISSING else f"a {type(value).__name__}"
        fail(file, f"{field}.{name}", f"is {found}, expected {getattr(kind, '__name__', kind)}")
    return value


def _size(value: Any, file: Path, field: str, dims: Optional[int] = None) -> tuple[int, ...]:
    if not isinstance(value, torch.Size) or len(value) > MAX_DIMS or not all(is_count(n) for n in value):
        fail(file, field, f"is {value!r:.80}, expected a size of at most {MAX_DIMS} non-negative ints")
    if dims is not None and len(value) != dims:
        fail(file, field, f"has {len(value)} dimensions, the tensor {dims}")
    return tuple(value)


def check_index(metadata: Any, file: Path) -> Metadata:
    """``metadata`` (an unpickled ``.metadata`` file) if it is safe to read through; raises otherwise."""
    if not isinstance(metadata, Metadata):
        fail(file, "index", f"is a {type(metadata).__name__}, expected a DCP `Metadata`")
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is not None and not isinstance(storage_meta, StorageMeta):
        fail(file, "storage_meta", f"is a {type(storage_meta).__name__}")
    storage = _attr(metadata, "storage_data", dict, file, "index")
    record_ends(storage, file)
    tensors = _attr(metadata, "state_dict_metadata", dict, file, "index")
    for fqn, entry in tensors.items():
        if not isinstance(fqn, str):
            fail(file, "state_dict_metadata", f"has a key of type {type(fqn).__name__}")
        _check_tensor(fqn, entry, storage, file)
    return metadata


def _check_tensor(fqn: str, entry: Any, storage: dict[Any, Any], file: Path) -> None:
    if isinstance(entry, BytesStorageMetadata):
        raise CheckpointError(
            f"{file}: `{fqn}` is a pickled object, which shardwise never writes and never reads from tensor files; "
            f"{HINT}"
        )
    if not isinstance(entry, TensorStorageMetadata):
        fail(file, fqn, f"is a {type(entry).__name__}, expected tensor metadata")
    properties = _attr(entry, "properties", TensorProperties, file, fqn)
    dtype = getattr(properties, "dtype", None)
    if not isinstance(dtype, torch.dtype) or dtype not in TENSOR_DTYPES.values():
        fail(file, f"{fqn}.dtype", f"is {dtype!r:.40}, not a tensor dtype shardwise stores")
    size = _size(getattr(entry, "size", None), file, f"{fqn}.size")
    chunks = _attr(entry, "chunks", list, file, fqn)
    spans = []
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, ChunkStorageMetadata):
            fail(file, f"{fqn}.chunks[{i}]", f"is a {type(chunk).__name__}")
        offsets = _size(getattr(chunk, "offsets", None), file, f"{fqn}.chunks[{i}].offsets", len(size))
        sizes = _size(getattr(chunk, "sizes", None), file, f"{fqn}.chunks[{i}].sizes", len(size))
        spans.append((offsets, sizes))
        info, nbytes = storage.get(MetadataIndex(fqn, offsets)), math.prod(sizes) * dtype.itemsize
        if info is None:
            fail(file, f"{fqn}.chunks", f"include offset {offsets} with no storage record")
        if info.length < nbytes:
            fail(file, f"storage_data[{fqn}@{offsets}].length", f"is {info.length} bytes, less than the {nbytes} its chunk holds")
    _check_cover(fqn, size, spans, file)


def _check_cover(fqn: str, size: tuple[int, ...], spans: list[tuple[tuple[int, ...], tuple[int, ...]]], file: Path) -> None:
    """Chunks cover every element exactly once: shardwise writes 1-D tensors (flattened masters, per-element
    optimizer state) as any set of ranges, everything else as one whole chunk."""
    if len(size) != 1:
        if len(spans) != 1 or any(spans[0][0]) or spans[0][1] != size:
            fail(file, f"{fqn}.chunks", f"are {spans!r:.120}, expected one chunk covering the whole size {size}")
        return
    end = 0
    for (start,), (length,) in sorted(spans):
        if start != end:
            what = "overlap" if start < end else "leave a gap"
            fail(file, f"{fqn}.chunks", f"{what} at element {min(start, end)} of {size[0]}; each element must be saved once")
        end = start + length
    if end != size[0]:
        fail(file, f"{fqn}.chunks", f"cover elements [0, {end}) of {size[0]}")


def record_ends(storage: dict[Any, Any], file: Path) -> dict[str, int]:
    """``{data file: bytes it must have}``; raises unless every record is a bare data-file name and
    records do not overlap (so no two chunks share bytes)."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for key, info in storage.items():
        where = f"storage_data[{getattr(key, 'fqn', key)!r:.80}]"
        if not isinstance(key, MetadataIndex):
            fail(file, where, f"has a key of type {type(key).__name__}")
        path = getattr(info, "relative_path", None)
        if not isinstance(path, str) or not _DATA_FILE.fullmatch(path):
            fail(file, f"{where}.relative_path", f"is {path!r:.80}, expected a file name `__R_N.distcp` inside the checkpoint")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (is_count(offset) and is_count(length)):
            fail(file, where, f"has offset {offset!r:.40} and length {length!r:.40}, expected non-negative ints")
        if getattr(info, "transform_descriptors", None):
            fail(file, f"{where}.transform_descriptors", "name stream transforms, which shardwise never writes")
        ranges.setdefault(path, []).append((offset, offset + length))
    ends = {}
    for path, spans in ranges.items():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            if start < end:
                fail(file, f"storage_data ({path})", f"has records that overlap at byte {start}")
        ends[path] = spans[-1][1]
    return ends
