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
from typing import Any, Iterator

import torch

from .errors import CheckpointError

__all__ = ["Decoder", "Encoder", "refuse_pickles", "tensor_refs"]

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
            return {"__dtype__": str(value).replace("torch.", "")}
        if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
            return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
        return self._pickle(value, where)

    def _tensor(self, value: torch.Tensor) -> dict[str, Any]:
        key = f"{self.prefix}/{len(self.tensors)}"
        self.tensors[key] = value.detach()
        return {"__tensor__": key, "shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", "")}

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
    """Decodes :class:`Encoder` output; ``tensors`` holds the loaded referenced tensors."""

    tensors: dict[str, torch.Tensor]
    allow_pickle: bool = False

    def decode(self, data: Any, where: str) -> Any:
        if isinstance(data, list):
            return [self.decode(v, f"{where}[{i}]") for i, v in enumerate(data)]
        if not isinstance(data, dict):
            return data
        if not any(k.startswith("__") for k in data):
            return {k: self.decode(v, f"{where}[{k!r}]") for k, v in data.items()}
        return self._tagged(data, where)

    def _tagged(self, data: dict[str, Any], where: str) -> Any:
        if "__tensor__" in data:
            return self.tensors[data["__tensor__"]]
        if "__tuple__" in data:
            return tuple(self.decode(v, where) for v in data["__tuple__"])
        if "__dict__" in data:
            return {self.decode(k, where): self.decode(v, where) for k, v in data["__dict__"]}
        if "__float__" in data:
            return float(data["__float__"])
        if "__bytes__" in data:
            return base64.b64decode(data["__bytes__"])
        if "__dtype__" in data:
            return getattr(torch, data["__dtype__"])
        if "__ndarray__" in data:
            import numpy

            return numpy.asarray(data["__ndarray__"], dtype=data["dtype"])
        if "__pickle__" in data:
            return self._unpickle(data, where)
        raise CheckpointError(
            f"`{where}` in the checkpoint has an unknown tag {sorted(data)}; was it written by a newer shardwise?"
        )

    def _unpickle(self, data: dict[str, Any], where: str) -> Any:
        if not self.allow_pickle:
            raise CheckpointError(
                f"`{where}` in this checkpoint is a pickled `{data.get('type', '?')}` and loading it needs "
                f"arbitrary unpickling, which is off by default: {_PICKLE_HINT}"
            )
        return pickle.loads(base64.b64decode(data["__pickle__"]))


def tensor_refs(data: Any) -> Iterator[dict[str, Any]]:
    """Every ``__tensor__`` reference inside encoded ``data``."""
    if isinstance(data, list):
        for item in data:
            yield from tensor_refs(item)
    elif isinstance(data, dict):
        if "__tensor__" in data:
            yield data
            return
        for value in data.values():
            yield from tensor_refs(value)


def refuse_pickles(data: Any, where: str, allow_pickle: bool) -> None:
    """Raise (as decoding would) if encoded ``data`` holds a pickle and ``allow_pickle`` is off.

    Lets a load refuse before it has changed anything.
    """
    if allow_pickle:
        return
    if isinstance(data, list):
        for item in data:
            refuse_pickles(item, where, allow_pickle)
    elif isinstance(data, dict):
        if "__pickle__" in data:
            Decoder({}, allow_pickle=False).decode(data, where)
        for key, value in data.items():
            refuse_pickles(value, f"{where}[{key!r}]" if not key.startswith("__") else where, allow_pickle)
