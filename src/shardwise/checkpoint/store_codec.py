"""JSON for what the checkpoint agreement passes through the c10d store: plain values and DCP's save plans.

The ranks of a save exchange DCP's ``SavePlan`` and ``WriteResult`` lists through the rendezvous store, and
anything that can write there could run code on every rank if they were pickles (docs/checkpoints.md, "Threat
model").  :func:`restore` builds only JSON's own values and tagged objects ``{"TAG": value}`` from fixed tables
(:data:`_DECODERS`, ``_tables``), DCP's plan dataclasses from exactly their constructor's fields, and file names only
as the bare ``__R_`` / ``__R_N.distcp`` a save makes; anything else is a :class:`StoreValueError` naming the key.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Union

import torch

from .codec import DTYPES, is_count
from .files import MAX_DEPTH, MAX_DIMS, MAX_STORE_VALUE_BYTES, StoreValueError

__all__ = ["dumps", "encode", "loads", "malformed", "restore"]


@dataclasses.dataclass(frozen=True)
class _Tables:
    """What a save plan may hold, looked up from DCP's own classes."""

    #: the classes a save's exchanges hold (torch 2.13); a plan holding anything else is not one shardwise made
    classes: dict[str, type]
    #: per class, what its constructor takes (what crosses the store of each object) and each field's type
    fields: dict[str, tuple[str, ...]]
    hints: dict[str, dict[str, Any]]
    #: tag -> name -> value, for the values sent by name (dtypes, layouts, memory formats, WriteItemType)
    names: dict[str, dict[str, Any]]
    named_kinds: dict[type, str]
    name_of: dict[Any, str]
    #: file names a plan may carry: what DCP's FileSystemWriter makes for rank R (never a path)
    file_names: dict[tuple[type, str], re.Pattern[str]]


@functools.cache
def _tables() -> _Tables:
    # built on first use: DCP takes ~0.6 s to import, and plain values (every `initialize`'s payloads) never need it
    from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    classes: dict[str, type] = {cls.__name__: cls for cls in (
        SavePlan, WriteItem, TensorWriteData, MetadataIndex, ChunkStorageMetadata, TensorProperties, WriteResult,
        _StorageInfo, _StoragePrefix,
    )}
    names: dict[str, dict[str, Any]] = {
        "dtype": DTYPES,
        "layout": {"strided": torch.strided, "sparse_coo": torch.sparse_coo},
        "memory_format": {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                          "preserve_format": torch.preserve_format},
        "WriteItemType": {item.name: item for item in WriteItemType},
    }
    return _Tables(
        classes=classes,
        fields={name: tuple(f.name for f in dataclasses.fields(cls) if f.init) for name, cls in classes.items()},
        hints={name: typing.get_type_hints(cls) for name, cls in classes.items()},
        names=names,
        named_kinds={torch.dtype: "dtype", torch.layout: "layout", torch.memory_format: "memory_format",
                     WriteItemType: "WriteItemType"},
        name_of={known: name for values in names.values() for name, known in values.items()},
        file_names={(_StoragePrefix, "prefix"): re.compile(r"__[0-9]{1,7}_"),
                    (_StorageInfo, "relative_path"): re.compile(r"__[0-9]{1,7}_[0-9]{1,7}\.distcp")},
    )


class _Bad(Exception):
    """What is wrong with one value; :func:`loads` adds which key held it."""


def encode(value: Any) -> Any:
    """``value`` as JSON-able data; raises ``TypeError`` on a type :func:`restore` would refuse."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode(v) for v in value]
    if kind is dict:
        return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
    tables = _tables()
    if tables.classes.get(kind.__name__) is kind:  # checked early: nearly every object of a plan is one
        return {kind.__name__: {name: encode(getattr(value, name)) for name in tables.fields[kind.__name__]}}
    if kind is torch.Size:
        return {"Size": list(value)}
    if kind is tuple:
        return {"tuple": [encode(v) for v in value]}
    if kind in tables.named_kinds and value in tables.name_of:
        return {tables.named_kinds[kind]: tables.name_of[value]}
    raise TypeError(f"a {kind.__module__}.{kind.__qualname__} cannot cross the store as JSON; "
                    "the checkpoint agreement passes only plain values and DCP's save plans")


def dumps(value: Any, tagged: bool = True) -> str:
    """``value`` as the JSON text one store key holds (``tagged``: through :func:`encode`, else plain JSON);
    raises ``ValueError`` above :data:`~.files.MAX_STORE_VALUE_BYTES`."""
    text = json.dumps(encode(value) if tagged else value, separators=(",", ":"))
    if len(text) > MAX_STORE_VALUE_BYTES:
        raise ValueError(f"the value is {len(text):,} bytes of JSON, above the store's bound of "
                         f"{MAX_STORE_VALUE_BYTES:,} (`shardwise.checkpoint.files.MAX_STORE_VALUE_BYTES`)")
    return text


def malformed(key: str, rank: int, problem: str) -> StoreValueError:
    """The error for store key ``key`` holding something no rank of the agreement wrote."""
    return StoreValueError(
        f"rank {rank}: the checkpoint agreement's store key `{key}` {problem}; only shardwise's ranks should write "
        "there (something else wrote to the job's rendezvous store, or the ranks run different versions of "
        "shardwise or torch): run every rank with the same versions (`shardwise env`) and keep the store's port "
        "closed to other programs"
    )


def loads(raw: Any, key: str, rank: int, tagged: bool = True) -> Any:
    """The value in store key ``key`` (bytes or text), through :func:`restore` if ``tagged``."""
    if not isinstance(raw, (bytes, str)):
        raise malformed(key, rank, f"is a {type(raw).__name__}, expected bytes")
    if len(raw) > MAX_STORE_VALUE_BYTES:
        raise malformed(key, rank, f"is {len(raw):,} bytes, above the bound of {MAX_STORE_VALUE_BYTES:,}")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise malformed(key, rank, f"is not JSON ({type(exc).__name__}: {str(exc):.80}; it starts "
                                   f"{raw[:24]!r})") from None
    return restore(data, key, rank) if tagged else data


def restore(data: Any, key: str, rank: int, expected: Any = Any) -> Any:
    """The value :func:`encode` made ``data`` from (read from store key ``key``), which must be of type
    ``expected`` (e.g. ``list[SavePlan]``); raises :class:`StoreValueError` on anything else."""
    try:
        value = _decode(data)
    except _Bad as bad:
        raise malformed(key, rank, str(bad)) from None
    if not _fits(value, expected):
        raise malformed(key, rank, f"holds {value!r:.80}, expected a {expected}")
    return value


def _decode(data: Any, depth: int = 0) -> Any:
    """The value :func:`encode` made ``data`` from; raises ``_Bad`` (private) on anything else."""
    if depth > MAX_DEPTH:
        raise _Bad(f"nests deeper than {MAX_DEPTH} levels")
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [_decode(v, depth + 1) for v in data]
    if not (isinstance(data, dict) and len(data) == 1):
        raise _Bad(f"holds {str(data):.80}, expected a value or a one-key tagged object")
    ((tag, value),) = data.items()
    decoder = _DECODERS.get(tag)
    if decoder is None:
        tables = _tables()
        decoder = _named if tag in tables.names else _dataclass if tag in tables.classes else None
        if decoder is None:
            known = sorted([*_DECODERS, *tables.names, *tables.classes])
            raise _Bad(f"holds an object tagged {tag!r:.60}, which is none of {known}")
    return decoder(tag, value, depth + 1)


def _items(tag: str, value: Any, depth: int) -> list[Any]:
    if not isinstance(value, list):
        raise _Bad(f"holds `{tag}` as a {type(value).__name__}, expected a list")
    return [_decode(v, depth) for v in value]


def _dict(tag: str, value: Any, depth: int) -> dict[Any, Any]:
    pairs = _items(tag, value, depth)
    if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise _Bad("holds a `dict` whose entries are not [key, value] pairs")
    try:
        return {k: v for k, v in pairs}
    except TypeError:
        raise _Bad("holds a `dict` with an unhashable key") from None


def _size(tag: str, value: Any, depth: int) -> torch.Size:
    dims = _items(tag, value, depth)
    if len(dims) > MAX_DIMS or not all(is_count(n) for n in dims):
        raise _Bad(f"holds `Size` {str(value):.80}, expected at most 64 non-negative ints")
    return torch.Size(dims)


def _named(tag: str, value: Any, depth: int) -> Any:
    names = _tables().names[tag]
    if not isinstance(value, str) or value not in names:
        raise _Bad(f"holds `{tag}` {value!r:.60}, expected one of {sorted(names)}")
    return names[value]


def _dataclass(tag: str, value: Any, depth: int) -> Any:
    tables = _tables()
    cls = tables.classes[tag]
    fields = tables.fields[tag]
    if not isinstance(value, dict) or set(value) != set(fields):
        got = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise _Bad(f"holds a `{tag}` with fields {got}, expected {sorted(fields)}")
    hints = tables.hints[tag]
    values = {name: _decode(v, depth) for name, v in value.items()}
    for name, v in values.items():
        if not _fits(v, hints.get(name, Any)):
            raise _Bad(f"holds a `{tag}` whose `{name}` is {v!r:.60}, expected {hints[name]}")
        pattern = tables.file_names.get((cls, name))
        if pattern is not None and not pattern.fullmatch(v):
            raise _Bad(f"holds a `{tag}` whose `{name}` is {v!r:.60}, expected a bare name `{pattern.pattern}`")
    return cls(**values)


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the type ``hint`` (unions, lists, sequences, fixed tuples and dicts looked into)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin in (list, Sequence):
        return isinstance(value, (list, tuple)) and all(_fits(v, args[0]) for v in value if args)
    if origin is tuple:
        return isinstance(value, tuple) and len(value) == len(args) and all(map(_fits, value, args))
    if origin is dict:
        return isinstance(value, dict) and all(_fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items())
    if isinstance(hint, type):
        return isinstance(value, hint) and not (isinstance(value, bool) and hint is int)
    return hint is None and value is None


#: the tags whose decoding needs no DCP class (the named values and DCP's dataclasses: see `_tables`)
_DECODERS: dict[str, Callable[[str, Any, int], Any]] = {
    "tuple": lambda tag, value, depth: tuple(_items(tag, value, depth)), "dict": _dict, "Size": _size,
}
