"""Plain Python values <-> JSON, with tensors kept aside for the tensor store, walked without recursion.

``client_state``, scheduler, loss-scaler and RNG states and optimizer hyperparameters are written as JSON, so
reading a checkpoint never unpickles them: a tensor inside becomes ``{"__tensor__": key, "shape", "dtype"}``
(the tensor goes to the tensor files), and types JSON lacks are tagged (``__tuple__``, ``__bytes__``,
``__float__`` for nan/inf, ``__dict__`` for non-string keys, ``__dtype__``, ``__ndarray__``).  Anything else
needs pickle, which saving and loading both refuse unless ``checkpoint.allow_pickle`` says so.

Readers walk the data with an explicit stack, nesting bounded by ``MAX_DEPTH``; where a value sits
(``client_state['a'][3]``) is rendered only for an error, from each open container's parent and position.
"""

from __future__ import annotations

import base64
import math
import pickle
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence, TypeGuard

import torch

from .files import MAX_DEPTH, MAX_DIMS, CheckpointError

__all__ = [
    "DTYPES", "NUMPY_DTYPES", "TENSOR_DTYPES", "Decoder", "Encoder", "check_encoded", "dtype_name", "empty_tensors",
    "is_count", "refuse_pickles",
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


# tag -> (its other required keys, optional keys) of a tagged dict
_TAGS: dict[str, tuple[set[str], set[str]]] = {
    "__tensor__": ({"shape", "dtype"}, set()), "__tuple__": (set(), set()), "__dict__": (set(), set()),
    "__float__": (set(), set()), "__bytes__": (set(), set()), "__dtype__": (set(), set()),
    "__ndarray__": ({"dtype"}, set()), "__pickle__": (set(), {"type"}),
}
_CONTAINERS = ("__tuple__", "__dict__")
_NON_FINITE = frozenset({"nan", "inf", "-inf"})
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


def is_count(value: Any) -> TypeGuard[int]:
    """A non-negative ``int`` (not a bool)."""
    return type(value) is int and value >= 0


class _Bad(Exception):
    """What is wrong with one value; the caller adds where it is."""


def _tag(data: dict[Any, Any]) -> Optional[str]:
    """The tag of a tagged dict (``{"__tuple__": ...}``), None for a plain one; malformed ones raise."""
    if not any(isinstance(k, str) and k.startswith("__") for k in data):
        return None
    tags = [k for k in data if k in _TAGS]
    if len(tags) == 1:
        required, optional = {tags[0], *_TAGS[tags[0]][0]}, _TAGS[tags[0]][1]
        if required <= data.keys() <= required | optional:
            return tags[0]
    keys = sorted(str(k)[:40] for k in data)[:8]
    raise _Bad(f"is a dict with keys {keys}, which is no value shardwise writes (was it written by a newer shardwise, or edited?)")


def _leaf_problem(data: dict[str, Any], tag: str) -> Optional[str]:
    value = data[tag]
    if tag == "__tensor__":
        shape = data["shape"]
        if not isinstance(value, str):
            return "the tensor key is not a string"
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(is_count(n) for n in shape):
            return f"shape {shape!r:.80} is not a list of at most {MAX_DIMS} non-negative ints"
        if data["dtype"] not in TENSOR_DTYPES:
            return f"dtype {data['dtype']!r:.40} is not a tensor dtype shardwise stores"
    elif tag == "__float__" and value not in _NON_FINITE:
        return f"`__float__` is {value!r:.40}, expected one of {sorted(_NON_FINITE)}"
    elif tag in ("__bytes__", "__pickle__") and not (isinstance(value, str) and _BASE64.fullmatch(value)):
        return f"`{tag}` is not base64 text"
    elif tag == "__dtype__" and value not in DTYPES:
        return f"`__dtype__` is {value!r:.40}, which is not a torch dtype"
    elif tag == "__ndarray__" and (not isinstance(value, list) or data["dtype"] not in NUMPY_DTYPES):
        return f"`__ndarray__` needs a list and a numeric dtype, got dtype {data['dtype']!r:.40}"
    return None


def _key_label(key: Any) -> str:
    return f"{key!r:.60}" if isinstance(key, (str, int, float, bool, type(None))) else type(key).__name__


class Node:
    """A container being walked: its children, its place in its parent, and what was built of it so far."""

    __slots__ = ("kind", "values", "keys", "parent", "slot", "depth", "label", "out", "next")

    def __init__(self, kind: str, values: Sequence[Any], keys: Sequence[Any], parent: Optional["Node"],
                 slot: int, depth: int, label: str = "") -> None:
        self.kind, self.values, self.keys, self.parent, self.slot = kind, values, keys, parent, slot
        self.depth, self.label = depth, label
        self.out: list[Any] = []
        self.next = 0

    def child_label(self, i: int) -> str:
        if self.kind == "root":
            return ""
        if self.kind == "dict":
            return f"[{_key_label(self.keys[i])}]"
        if self.kind == "pairs":
            return " key" if i % 2 == 0 else f"[{_key_label(self.values[i - 1])}]"
        return f"[{i}]"

    def where(self) -> str:
        parts, node = [], self
        while node.parent is not None:
            parts.append(node.parent.child_label(node.slot))
            node = node.parent
        return node.label + "".join(reversed(parts))

    def child_where(self, i: int) -> str:
        return self.where() + self.child_label(i)

    def build(self) -> Any:
        """The decoded container from ``out`` (its decoded children)."""
        if self.kind == "tuple":
            return tuple(self.out)
        if self.kind == "dict":
            return dict(zip(self.keys, self.out))
        if self.kind != "pairs":
            return self.out
        built = {}
        for i in range(0, len(self.out), 2):
            try:
                built[self.out[i]] = self.out[i + 1]
            except TypeError:
                raise CheckpointError(
                    f"`{self.child_where(i)}` is a `{type(self.out[i]).__name__}`, which cannot be a dict key"
                ) from None
        return built


def expand(node: Node, i: int) -> Optional[Node]:
    """Child ``i`` of ``node`` as a container to walk into, or None for a leaf; nesting is bounded."""
    data = node.values[i]
    depth = node.depth + 1
    if not isinstance(data, (list, dict)):
        return None
    try:
        child = Node("list", data, (), node, i, depth) if isinstance(data, list) else _tagged_container(data, node, i, depth)
    except _Bad as bad:
        raise CheckpointError(f"`{node.child_where(i)}` in the checkpoint {bad}") from None
    if child is None:
        return None
    if depth > MAX_DEPTH:
        where = node.child_where(i)
        where = where if len(where) <= 100 else f"{where[:60]}...{where[-30:]}"
        raise CheckpointError(
            f"`{where}` in the checkpoint nests values more than {MAX_DEPTH} deep; shardwise does not read such data "
            "(keep `client_state` and scheduler state shallower)"
        )
    return child


def _tagged_container(data: dict[Any, Any], node: Node, i: int, depth: int) -> Optional[Node]:
    tag = _tag(data)
    if tag is None:
        return Node("dict", list(data.values()), list(data), node, i, depth)
    if tag not in _CONTAINERS:
        return None
    items = data[tag]
    if not isinstance(items, list):
        raise _Bad(f"is malformed: `{tag}` holds a {type(items).__name__}, expected a list")
    if tag == "__tuple__":
        return Node("tuple", items, (), node, i, depth)
    if not all(isinstance(p, list) and len(p) == 2 for p in items):
        raise _Bad("is malformed: `__dict__` must be a list of [key, value] pairs")
    return Node("pairs", [item for pair in items for item in pair], (), node, i, depth)


def leaf_tag(node: Node, i: int) -> Optional[str]:
    """The tag of leaf ``i`` of ``node`` (a tensor reference, float, bytes...) once checked; None for plain values."""
    data = node.values[i]
    if not isinstance(data, dict):
        return None
    try:
        tag = _tag(data)
        problem = _leaf_problem(data, tag) if tag is not None and tag not in _CONTAINERS else None
        if problem is not None:
            raise _Bad(f"is malformed: {problem}")
    except _Bad as bad:
        raise CheckpointError(f"`{node.child_where(i)}` in the checkpoint {bad}") from None
    return tag if tag not in _CONTAINERS else None


def walk(data: Any, where: str,
         done: Optional[Callable[[Node], None]] = None) -> Iterator[tuple[Node, int, Optional[Node]]]:
    """``(container, position, the value as a container to walk into or None)`` of every value inside encoded
    ``data``, containers before their children; ``done(container)`` once its children are walked."""
    stack = [Node("root", [data], [], None, 0, 0, where)]
    while stack:
        node = stack[-1]
        if node.next == len(node.values):
            stack.pop()
            if done is not None:
                done(node)
            continue
        i = node.next
        node.next += 1
        child = expand(node, i)
        yield node, i, child
        if child is not None:
            stack.append(child)


def check_encoded(data: Any, where: str) -> list[dict[str, Any]]:
    """Raise if encoded ``data`` could not be decoded; its tensor references otherwise."""
    return [node.values[i] for node, i, _ in walk(data, where) if leaf_tag(node, i) == "__tensor__"]


def empty_tensors(data: Any) -> dict[str, torch.Tensor]:
    """A fresh tensor to read each tensor that encoded ``data`` refers to into, by key."""
    refs = [v for node, i, _ in walk(data, "value") if isinstance(v := node.values[i], dict) and "__tensor__" in v]
    return {ref["__tensor__"]: torch.empty(ref["shape"], dtype=getattr(torch, ref["dtype"])) for ref in refs}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


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
            key = f"{self.prefix}/{len(self.tensors)}"
            self.tensors[key] = value.detach()
            return {"__tensor__": key, "shape": list(value.shape), "dtype": dtype_name(value.dtype)}
        if isinstance(value, (list, tuple)):
            items = [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
            return items if isinstance(value, list) else {"__tuple__": items}
        if isinstance(value, dict):
            return self._dict(value, where)
        if isinstance(value, bytes):
            return {"__bytes__": base64.b64encode(value).decode()}
        if isinstance(value, torch.dtype):
            if dtype_name(value) not in DTYPES:
                raise CheckpointError(f"`{where}` holds `{value}`, a dtype shardwise checkpoints do not store")
            return {"__dtype__": dtype_name(value)}
        if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
            return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
        return self._pickle(value, where)

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
    """Decodes :class:`Encoder` output (``tensors``: the loaded tensors it refers to) into plain values, those
    tensors, dtypes and numeric numpy arrays only (unpickled objects only with ``allow_pickle``)."""

    tensors: dict[str, torch.Tensor]
    allow_pickle: bool = False

    def decode(self, data: Any, where: str) -> Any:
        built: list[Any] = []  # the root's, once walked: its one child, decoded
        for node, i, child in walk(data, where, lambda n: (n.parent.out if n.parent else built).append(n.build())):
            if child is None:
                node.out.append(self._leaf(node, i))
        return built[0][0]

    def _leaf(self, node: Node, i: int) -> Any:
        data = node.values[i]
        tag = leaf_tag(node, i)
        if tag is None:
            return data
        if tag == "__tensor__":
            key = data["__tensor__"]
            if key not in self.tensors:
                raise CheckpointError(f"`{node.child_where(i)}` refers to tensor `{key:.80}`, which this checkpoint does not hold")
            return self.tensors[key]
        if tag == "__float__":
            return float(data["__float__"])
        if tag == "__bytes__":
            return base64.b64decode(data["__bytes__"], validate=True)
        if tag == "__dtype__":
            return DTYPES[data["__dtype__"]]
        if tag == "__ndarray__":
            return _ndarray(data, node.child_where(i))
        if not self.allow_pickle:
            raise CheckpointError(
                f"`{node.child_where(i)}` in this checkpoint is a pickled `{data.get('type', '?')}` and loading it "
                "needs arbitrary unpickling, which is off by default: set `checkpoint.allow_pickle: true` in the config "
                "only if you trust this checkpoint (unpickling can run arbitrary code)"
            )
        return pickle.loads(base64.b64decode(data["__pickle__"]))


def _ndarray(data: dict[str, Any], where: str) -> Any:
    try:
        import numpy  # here: only a checkpoint holding numpy arrays needs numpy, an optional import
    except ImportError:
        raise CheckpointError(f"`{where}` in the checkpoint is a numpy array, and numpy is not installed") from None
    try:
        return numpy.asarray(data["__ndarray__"], dtype=data["dtype"])
    except (TypeError, ValueError, OverflowError) as exc:
        raise CheckpointError(f"`{where}` in the checkpoint is not a {data['dtype']} array: {exc}") from None


def refuse_pickles(data: Any, where: str, allow_pickle: bool) -> None:
    """Raise (as decoding would) if encoded ``data`` holds a pickle and ``allow_pickle`` is off: a load
    refuses before it has changed anything."""
    if allow_pickle:
        return
    for node, i, _ in walk(data, where):
        value = node.values[i]
        if isinstance(value, dict) and "__pickle__" in value:
            Decoder({}, allow_pickle=False).decode(value, node.child_where(i))
