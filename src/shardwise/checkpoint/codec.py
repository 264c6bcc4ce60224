"""Plain Python values <-> JSON, with tensors kept aside for the tensor store.

``client_state``, the scheduler's and loss scaler's ``state_dict``, optimizer
hyperparameters and RNG states are mostly plain values.  They are written as
JSON, so reading a checkpoint never unpickles them; each tensor inside becomes
a reference ``{"__tensor__": key, "shape": ..., "dtype": ...}`` and the tensor
itself goes to the sharded tensor files.  Python types JSON lacks are tagged
(``__tuple__``, ``__bytes__``, ``__float__`` for nan/inf, ``__dict__`` for
non-string keys, ``__dtype__``, ``__ndarray__``).

Anything else (an arbitrary object) would need pickle.  Saving it requires
``checkpoint.allow_pickle``; loading it requires it too, so a checkpoint from
someone else cannot run code in this process unless the user says so.
"""

from __future__ import annotations

import base64
import math
import pickle
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

from .errors import CheckpointError
from .limits import MAX_DEPTH, MAX_DIMS

__all__ = [
    "DTYPES", "Decoder", "Encoder", "NUMPY_DTYPES", "TENSOR_DTYPES", "check_encoded", "check_leaf", "is_count",
    "refuse_pickles", "tensor_refs", "walk",
]

# The names `__dtype__` may carry: torch dtypes and nothing else (an allow-list, never `getattr(torch, name)`).
_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "qint8", "quint8", "qint32", "quint4x2", "quint2x4",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
    "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
)
DTYPES: dict[str, torch.dtype] = {
    name: dtype for name in _DTYPE_NAMES if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}
# Dtypes of tensors a checkpoint stores (whole bytes per element, so sizes can be checked against the disk).
TENSOR_DTYPES: dict[str, torch.dtype] = {name: DTYPES[name] for name in _DTYPE_NAMES[:21] if name in DTYPES}
NUMPY_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
     "float64", "complex64", "complex128"}
)

_PICKLE_HINT = (
    "set `checkpoint.allow_pickle: true` in the config only if you trust this checkpoint "
    "(unpickling can run arbitrary code)"
)


@dataclass
class Encoder:
    """Encodes values, collecting their tensors in ``tensors`` under ``prefix/<n>``."""

    prefix: str
    allow_pickle: bool = False
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def encode(self, value: Any, where: str) -> Any:
        """``value`` as JSON-able data; ``where`` names it in errors (e.g. ``client_state``)."""
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return value if math.isfinite(value) else {"__float__": repr(value)}
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, (list, tuple)):
            items = [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
            return items if isinstance(value, list) else {"__tuple__": items}
        if isinstance(value, dict):
            return self._dict(value, where)
        if isinstance(value, bytes):
            return {"__bytes__": base64.b64encode(value).decode()}
        if isinstance(value, torch.dtype):
            return self._dtype(value, where)
        if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
            return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
        return self._pickle(value, where)

    def _tensor(self, value: torch.Tensor) -> dict[str, Any]:
        key = f"{self.prefix}/{len(self.tensors)}"
        self.tensors[key] = value.detach()
        return {"__tensor__": key, "shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", "")}

    def _dtype(self, value: torch.dtype, where: str) -> dict[str, Any]:
        name = str(value).replace("torch.", "")
        if name not in DTYPES:
            raise CheckpointError(f"`{where}` holds `{value}`, a dtype shardwise checkpoints do not store")
        return {"__dtype__": name}

    def _dict(self, value: dict[Any, Any], where: str) -> Any:
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: self.encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        pairs = [[self.encode(k, f"{where} key"), self.encode(v, f"{where}[{k!r}]")] for k, v in value.items()]
        return {"__dict__": pairs}

    def _pickle(self, value: Any, where: str) -> dict[str, Any]:
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        if not self.allow_pickle:
            raise CheckpointError(
                f"`{where}` holds a `{kind}`, which a checkpoint can only store by pickling it; pass plain "
                "values (numbers, strings, lists, dicts, tensors) or set `checkpoint.allow_pickle: true` "
                "in the config (loading it will need that option too)"
            )
        return {"__pickle__": base64.b64encode(pickle.dumps(value)).decode(), "type": kind}


@dataclass
class Decoder:
    """Decodes :class:`Encoder` output; ``tensors`` holds the loaded referenced tensors.

    Decoding walks the data with an explicit stack (no recursion, nesting at
    most ``MAX_DEPTH``), and a malformed value is a :class:`CheckpointError`
    naming where it is: what a checkpoint holds never reaches Python as
    anything but plain values, tensors it references, torch dtypes and numpy
    arrays of plain numbers (and, only with ``allow_pickle``, unpickled objects).
    """

    tensors: dict[str, torch.Tensor]
    allow_pickle: bool = False

    def decode(self, data: Any, where: str) -> Any:
        root = _Node("list", [(data, where)], [], 0)
        stack = [root]
        while stack:
            node = stack[-1]
            if node.next == len(node.items):
                stack.pop()
                if stack:
                    stack[-1].out.append(node.build())
                continue
            value, at = node.items[node.next]
            node.next += 1
            child = _expand(value, at, node.depth + 1)
            if child is None:
                node.out.append(self._leaf(value, at))
            else:
                stack.append(child)
        return root.out[0]

    def _leaf(self, data: Any, where: str) -> Any:
        if not isinstance(data, dict):
            return data
        tag = check_leaf(data, where)
        if tag == "__tensor__":
            key = data["__tensor__"]
            if key not in self.tensors:
                raise CheckpointError(f"`{where}` refers to tensor `{key}`, which this checkpoint does not hold")
            return self.tensors[key]
        if tag == "__float__":
            return float(data["__float__"])
        if tag == "__bytes__":
            return base64.b64decode(data["__bytes__"], validate=True)
        if tag == "__dtype__":
            return DTYPES[data["__dtype__"]]
        if tag == "__ndarray__":
            return _ndarray(data, where)
        return self._unpickle(data, where)

    def _unpickle(self, data: dict[str, Any], where: str) -> Any:
        if not self.allow_pickle:
            raise CheckpointError(
                f"`{where}` in this checkpoint is a pickled `{data.get('type', '?')}` and loading it needs "
                f"arbitrary unpickling, which is off by default: {_PICKLE_HINT}"
            )
        return pickle.loads(base64.b64decode(data["__pickle__"]))


# ------------------------------------------------------------ structure

# tag -> (required keys, optional keys) of a tagged dict
_TAGS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "__tensor__": (frozenset({"__tensor__", "shape", "dtype"}), frozenset()),
    "__tuple__": (frozenset({"__tuple__"}), frozenset()),
    "__dict__": (frozenset({"__dict__"}), frozenset()),
    "__float__": (frozenset({"__float__"}), frozenset()),
    "__bytes__": (frozenset({"__bytes__"}), frozenset()),
    "__dtype__": (frozenset({"__dtype__"}), frozenset()),
    "__ndarray__": (frozenset({"__ndarray__", "dtype"}), frozenset()),
    "__pickle__": (frozenset({"__pickle__"}), frozenset({"type"})),
}
_NON_FINITE = frozenset({"nan", "inf", "-inf"})
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


def _tag(data: dict[Any, Any], where: str) -> Optional[str]:
    """The tag of a tagged dict (``{"__tuple__": ...}``), None for a plain one; malformed ones raise."""
    if not any(isinstance(k, str) and k.startswith("__") for k in data):
        return None
    tags = [k for k in data if k in _TAGS]
    if len(tags) == 1:
        required, optional = _TAGS[tags[0]]
        if required <= data.keys() <= required | optional:
            return tags[0]
    raise CheckpointError(
        f"`{where}` in the checkpoint is a dict with keys {sorted(map(str, data))[:8]}, which is no value shardwise "
        "writes (was it written by a newer shardwise, or edited?)"
    )


@dataclass
class _Node:
    """A list, tuple or dict being decoded: its children, and what was decoded of them so far."""

    kind: str
    items: list[tuple[Any, str]]
    keys: list[str]
    depth: int
    out: list[Any] = field(default_factory=list)
    next: int = 0

    def build(self) -> Any:
        if self.kind == "list":
            return self.out
        if self.kind == "tuple":
            return tuple(self.out)
        if self.kind == "dict":
            return dict(zip(self.keys, self.out))
        built = {}
        for i in range(0, len(self.out), 2):
            key = self.out[i]
            try:
                built[key] = self.out[i + 1]
            except TypeError:
                raise CheckpointError(
                    f"`{self.items[i][1]}` is a `{type(key).__name__}`, which cannot be a dict key"
                ) from None
        return built


def _expand(data: Any, where: str, depth: int) -> Optional[_Node]:
    """``data`` as a container to walk into, or None for a leaf; nesting is bounded by ``MAX_DEPTH``."""
    if isinstance(data, list):
        node = _Node("list", [(v, f"{where}[{i}]") for i, v in enumerate(data)], [], depth)
    elif not isinstance(data, dict):
        return None
    else:
        tag = _tag(data, where)
        if tag is None:
            node = _Node("dict", [(v, f"{where}[{k!r}]") for k, v in data.items()], list(data), depth)
        elif tag == "__tuple__":
            node = _Node("tuple", [(v, f"{where}[{i}]") for i, v in enumerate(_list(data, tag, where))], [], depth)
        elif tag == "__dict__":
            node = _Node("pairs", _pairs(data["__dict__"], where), [], depth)
        else:
            return None
    if depth > MAX_DEPTH:
        raise CheckpointError(
            f"`{_short(where)}` in the checkpoint nests values more than {MAX_DEPTH} deep; shardwise does not read such data "
            "(keep `client_state` and scheduler state shallower)"
        )
    return node


def _short(where: str) -> str:
    return where if len(where) <= 100 else f"{where[:60]}...{where[-30:]}"


def _list(data: dict[str, Any], tag: str, where: str) -> list[Any]:
    value = data[tag]
    if not isinstance(value, list):
        raise CheckpointError(f"`{where}`: `{tag}` holds a {type(value).__name__}, expected a list")
    return value


def _pairs(value: Any, where: str) -> list[tuple[Any, str]]:
    if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
        raise CheckpointError(f"`{where}`: `__dict__` must be a list of [key, value] pairs")
    return [item for k, v in value for item in ((k, f"{where} key"), (v, f"{where}[{k!r:.40}]"))]


def check_leaf(data: dict[str, Any], where: str) -> str:
    """The tag of leaf value ``data`` (a tensor reference, float, bytes...), checked for what decoding needs."""
    tag = _tag(data, where)
    if tag is None or tag in ("__tuple__", "__dict__"):
        raise CheckpointError(f"internal: `{where}` is not a leaf value")
    value = data[tag]
    problem = None
    if tag == "__tensor__":
        problem = _tensor_ref_problem(data)
    elif tag == "__float__" and value not in _NON_FINITE:
        problem = f"`__float__` is {value!r:.40}, expected one of {sorted(_NON_FINITE)}"
    elif tag in ("__bytes__", "__pickle__") and not (isinstance(value, str) and _BASE64.fullmatch(value)):
        problem = f"`{tag}` is not base64 text"
    elif tag == "__dtype__" and value not in DTYPES:
        problem = f"`__dtype__` is {value!r:.40}, which is not a torch dtype"
    elif tag == "__ndarray__" and (not isinstance(value, list) or data["dtype"] not in NUMPY_DTYPES):
        problem = f"`__ndarray__` needs a list and a numeric dtype, got dtype {data['dtype']!r:.40}"
    if problem is not None:
        raise CheckpointError(f"`{where}` in the checkpoint is malformed: {problem}")
    return tag


def _tensor_ref_problem(data: dict[str, Any]) -> Optional[str]:
    if not isinstance(data["__tensor__"], str):
        return "the tensor key is not a string"
    shape = data["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(is_count(n) for n in shape):
        return f"shape {shape!r:.80} is not a list of at most {MAX_DIMS} non-negative ints"
    if data["dtype"] not in TENSOR_DTYPES:
        return f"dtype {data['dtype']!r:.40} is not a tensor dtype shardwise stores"
    return None


def is_count(value: Any) -> bool:
    """A non-negative ``int`` (not a bool)."""
    return type(value) is int and value >= 0


def _ndarray(data: dict[str, Any], where: str) -> Any:
    import numpy

    try:
        return numpy.asarray(data["__ndarray__"], dtype=data["dtype"])
    except (TypeError, ValueError, OverflowError) as exc:
        raise CheckpointError(f"`{where}` in the checkpoint is not a {data['dtype']} array: {exc}") from None


def walk(data: Any, where: str) -> Iterator[tuple[Any, str]]:
    """Every value inside encoded ``data`` with where it is, containers first (no recursion)."""
    stack = [(data, where, 0)]
    while stack:
        value, at, depth = stack.pop()
        yield value, at
        node = _expand(value, at, depth + 1)
        if node is not None:
            stack.extend((v, w, depth + 1) for v, w in reversed(node.items))


def check_encoded(data: Any, where: str) -> list[dict[str, Any]]:
    """Raise if encoded ``data`` could not be decoded; its tensor references otherwise."""
    refs = []
    for value, at in walk(data, where):
        if isinstance(value, dict) and _tag(value, at) not in (None, "__tuple__", "__dict__"):
            if check_leaf(value, at) == "__tensor__":
                refs.append(value)
    return refs


def tensor_refs(data: Any) -> Iterator[dict[str, Any]]:
    """Every ``__tensor__`` reference inside encoded ``data``."""
    for value, _ in walk(data, "value"):
        if isinstance(value, dict) and "__tensor__" in value:
            yield value


def refuse_pickles(data: Any, where: str, allow_pickle: bool) -> None:
    """Raise (as decoding would) if encoded ``data`` holds a pickle and ``allow_pickle`` is off.

    Lets a load refuse before it has changed anything.
    """
    if allow_pickle:
        return
    for value, at in walk(data, where):
        if isinstance(value, dict) and "__pickle__" in value:
            Decoder({}, allow_pickle=False).decode(value, at)
