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
from dataclasses import dataclass, field
from typing import Any

import torch

from .encoded import DTYPES, Node, check_encoded, expand, leaf_tag, root, tensor_refs, walk
from .errors import CheckpointError

__all__ = ["Decoder", "Encoder", "check_encoded", "refuse_pickles", "tensor_refs"]

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
        top = root(data, where)
        stack = [top]
        while stack:
            node = stack[-1]
            if node.next == len(node.values):
                stack.pop()
                if stack:
                    stack[-1].out.append(node.build())
                continue
            i = node.next
            node.next += 1
            child = expand(node, i)
            if child is None:
                node.out.append(self._leaf(node, i))
            else:
                stack.append(child)
        return top.out[0]

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
        return self._unpickle(data, node.child_where(i))

    def _unpickle(self, data: dict[str, Any], where: str) -> Any:
        if not self.allow_pickle:
            raise CheckpointError(
                f"`{where}` in this checkpoint is a pickled `{data.get('type', '?')}` and loading it needs "
                f"arbitrary unpickling, which is off by default: {_PICKLE_HINT}"
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
    """Raise (as decoding would) if encoded ``data`` holds a pickle and ``allow_pickle`` is off.

    Lets a load refuse before it has changed anything.
    """
    if allow_pickle:
        return
    for node, i in walk(data, where):
        value = node.values[i]
        if isinstance(value, dict) and "__pickle__" in value:
            Decoder({}, allow_pickle=False).decode(value, node.child_where(i))
