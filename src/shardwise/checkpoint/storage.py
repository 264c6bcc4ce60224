"""``torch.distributed.checkpoint`` (DCP) as the storage and resharding layer.

DCP stores each tensor as *chunks* (offsets and sizes inside the global
tensor) and, on load, reads the overlap of whatever chunks were saved with
whatever chunks each rank asks for.  That is exactly resharding, provided a
rank can describe "elements ``[start, end)`` of this flattened parameter".
DTensor cannot (its uneven shards still follow a fixed chunking rule) and
ShardedTensor needs a collective to build its global metadata, so this module
adds :class:`FlatChunks` (any set of 1-D pieces of a 1-D tensor) and two
planners that understand it.  Replicated pieces (stage 0, or scalars such as
Adam's ``step``) are written once: DCP drops chunks with the same index.

Safety: the planners never write pickled objects (``BYTE_IO`` items) and refuse
to read them; tensors are read with ``torch.load(weights_only=True)`` by DCP,
each record first checked to be an uncompressed zip; the pickled
``.metadata`` file is read with an unpickler that only builds DCP's metadata
classes, torch dtypes/sizes and paths, then checked (``validate_index.py``)
before DCP plans anything with it.  DCP wraps every error in its own
``CheckpointException`` (a ``BaseException``); :func:`dcp_errors` turns it
back into a :class:`CheckpointError`.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
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
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .digests import verify
from .errors import CheckpointError
from .files import read_limited, regular_size
from .limits import MAX_INDEX_BYTES
from .validate_index import HINT, check_index, record_ends

__all__ = ["FlatChunks", "LoadPlanner", "SafeReader", "SavePlanner", "flatten", "dcp_errors", "read_metadata", "record_is_stored"]

INDEX = ".metadata"


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
        obj = self.state_dict[index.fqn]
        return obj.piece_at((index.offset or torch.Size([0]))[0]) if isinstance(obj, FlatChunks) else obj


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
            if isinstance(obj, FlatChunks):
                wanted = obj.chunks()
            else:
                wanted = [ChunkStorageMetadata(torch.Size([0] * obj.dim()), obj.size())]
            requests += create_read_items_for_chunk_list(fqn, md, wanted)
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.piece_at((index.offset or torch.Size([0]))[0]) if isinstance(obj, FlatChunks) else obj

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
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


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
    """DCP's ``.metadata`` index of the checkpoint in ``path``, unpickled safely and checked
    (:func:`~.validate_index.check_index`) before anything is read through it.

    A load reads the index twice (to check the checkpoint, then in DCP); the
    second time the same, unchanged file (same inode, size and mtime) is not
    unpickled and checked again.
    """
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


def record_is_stored(stream: Any, offset: int, length: int, where: str) -> None:
    """Raise unless the ``torch.save`` record at ``[offset, offset + length)`` is an uncompressed zip.

    A deflated entry could expand a small record into gigabytes when
    ``torch.load`` reads it; a stored one holds no more than its own bytes.
    Reads only the zip's central directory.
    """
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
        wanted = min(len(buffer), self.length - self.position)
        self.stream.seek(self.offset + self.position)
        data = self.stream.read(wanted)
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)


class SafeReader(FileSystemReader):
    """DCP's file reader, with the ``.metadata`` index unpickled by :func:`read_metadata`, and every
    tensor file this rank reads checked against the manifest's checksums (``expected``) first."""

    def __init__(self, path: Any, expected: dict[str, Any]) -> None:
        super().__init__(path)
        self.expected = expected

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path} has no global `.metadata` index; it was not written by shardwise")
        metadata = read_metadata(Path(self.path))
        storage_meta = metadata.storage_meta if metadata.storage_meta is not None else StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        for name, size in record_ends(metadata.storage_data, Path(self.path) / INDEX).items():
            if (regular_size(Path(self.path) / name) or 0) < size:
                raise CheckpointError(f"{Path(self.path) / name} is missing or shorter than its index says; {HINT}")
        return metadata

    def read_data(self, plan: LoadPlan, planner: Any) -> Any:
        # DCP reads each record straight into its destination (the engine's own tensors), so every
        # record this rank will read is checked first: a bad one fails the load before any is read.
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            by_file.setdefault(info.relative_path, []).append(info)
        for name, infos in by_file.items():
            verify(Path(self.path), name, self.expected)
            with open(Path(self.path) / name, "rb") as stream:
                for info in sorted(infos, key=lambda i: i.offset):
                    where = f"the tensor record at byte {info.offset} of {Path(self.path) / name}"
                    record_is_stored(stream, info.offset, info.length, where)
        return super().read_data(plan, planner)
