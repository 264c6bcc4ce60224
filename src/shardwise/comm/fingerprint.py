"""What must be equal on every rank for an engine to train right, as canonical text and its digest.

Three fingerprints, compared at ``initialize`` (:mod:`.construction`; docs/faults.md, "Ranks that build different
engines", lists what each covers and why): ``parameters``, ``config`` (every resolved value except
:data:`PER_RANK_KEYS`) and ``client``.  Each is an ordered list of bounded ``(key, value)`` texts; only the digests
cross the store.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..config import Config

__all__ = ["PER_RANK_KEYS", "Fingerprint", "client_fingerprint", "config_fingerprint", "module_fingerprint"]

#: config keys that may differ between ranks: none changes what a rank computes or which collectives it
#: issues.  ``seed`` seeds this rank's own random stream after the model is built (weights are broadcast
#: from rank 0 anyway; a per-rank seed for dropout or augmentation is common); ``wall_clock_breakdown``
#: only times this rank's own calls; the timeouts only bound how long this rank waits (each rank's
#: heartbeat carries its own interval, so peers judge it by its own timeout).
PER_RANK_KEYS = frozenset({"seed", "wall_clock_breakdown", "dist_timeout", "comms.timeout", "checkpoint.timeout"})

#: the longest value text kept whole; a longer one keeps a prefix and the digest of the whole
MAX_VALUE_CHARS = 200
_PREFIX_CHARS = 150

Entry = tuple[str, str]


@dataclass(frozen=True)
class Fingerprint:
    """An ordered list of ``(key, value)`` texts that must be equal on every rank; ``what`` names it."""

    what: str
    entries: tuple[Entry, ...]

    @functools.cached_property
    def digest(self) -> str:
        """sha256 of the canonical JSON of the entries."""
        return _sha256(json.dumps(self.entries, separators=(",", ":")))


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


def bounded(text: str) -> str:
    """``text``, or a prefix and the digest of the whole when it is longer than :data:`MAX_VALUE_CHARS`
    (two different long values stay different)."""
    if len(text) <= MAX_VALUE_CHARS:
        return text
    return f"{text[:_PREFIX_CHARS]}… ({len(text)} chars, sha256 {_sha256(text)[:16]})"


def canonical(value: Any) -> str:
    """The value as canonical JSON (sorted keys, exact floats, ``1.0`` written as ``1``), bounded."""
    return bounded(json.dumps(_plain(value), sort_keys=True, separators=(",", ":")))


def _plain(value: Any) -> Any:
    """A JSON-able copy of ``value``: tensors by value (one element) or shape, other objects by type."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)  # `lr=1` on one rank and `lr=1.0` on another are the same setting
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, torch.Tensor):
        return _plain(value.item()) if value.numel() == 1 else f"tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{_kind(value)}>"


def _kind(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


# ------------------------------------------------------------------ the model
def module_fingerprint(module: nn.Module) -> Fingerprint:
    """Every parameter, then every buffer, of ``module`` in registration order (ties included)."""
    entries = _tensor_entries("parameter", module.named_parameters(remove_duplicate=False))
    entries += _tensor_entries("buffer", module.named_buffers(remove_duplicate=False))
    return Fingerprint("parameters and buffers", tuple(entries))


def _tensor_entries(kind: str, named: Iterable[tuple[str, torch.Tensor]]) -> list[Entry]:
    first: dict[int, str] = {}
    entries = []
    for index, (name, tensor) in enumerate(named):
        # shape, dtype and requires_grad are metadata: readable on a ZeRO-3 partitioned parameter too
        text = f"`{name}` ({', '.join(map(str, tensor.shape))}) {str(tensor.dtype).removeprefix('torch.')}"
        if kind == "parameter" and not tensor.requires_grad:
            text += " frozen"
        tied = first.setdefault(id(tensor), name)
        if tied != name:
            text += f", the same tensor as `{tied}`"
        entries.append((f"{kind} #{index}", bounded(text)))
    return entries


# ----------------------------------------------------------------- the config
def config_fingerprint(config: Config) -> Fingerprint:
    """Every resolved config value by dotted key, except :data:`PER_RANK_KEYS`."""
    flat = _flatten(config.to_dict(), "")
    entries = tuple((key, canonical(value)) for key, value in sorted(flat.items()) if key not in PER_RANK_KEYS)
    return Fingerprint("configs", entries)


def _flatten(data: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


# ---------------------------------------------- what was passed besides the config
def client_fingerprint(module: nn.Module, optimizer: Any, lr_scheduler: Any,
                       model_parameters: Optional[list[Any]]) -> Fingerprint:
    """The optimizer, lr scheduler and ``model_parameters`` passed to ``initialize``.

    A callable is known by its qualified name (and a ``functools.partial`` by its
    arguments too): what a lambda closes over is not seen.
    """
    names = {id(p): name for name, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
    entries = _object_entries("optimizer", optimizer)
    entries += _groups("optimizer.param_groups", getattr(optimizer, "param_groups", None) or [], names)
    entries += _object_entries("lr_scheduler", lr_scheduler)
    entries += _scheduler_state(lr_scheduler)
    entries += _model_parameters(model_parameters, names)
    return Fingerprint("optimizers or lr schedulers passed to `initialize`", tuple(entries))


def _object_entries(key: str, obj: Any) -> list[Entry]:
    if obj is None:
        return [(key, "none")]
    if isinstance(obj, functools.partial):
        call = {"args": obj.args, "keywords": obj.keywords}
        return [(key, f"functools.partial of {_kind_of_callable(obj.func)}"), (f"{key}.partial", canonical(call))]
    if hasattr(obj, "step") or hasattr(obj, "param_groups"):
        return [(key, _kind(obj))]
    return [(key, _kind_of_callable(obj))]


def _kind_of_callable(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None)
    return f"callable {getattr(fn, '__module__', '?')}.{name}" if name else _kind(fn)


def _groups(prefix: str, groups: Iterable[Any], names: Mapping[int, str]) -> list[Entry]:
    entries = []
    for index, group in enumerate(groups):
        for key in sorted(group, key=str):
            value = group[key]
            text = _param_list(value, names) if key == "params" else canonical(value)
            entries.append((f"{prefix}[{index}].{key}", text))
    return entries


def _param_list(params: Any, names: Mapping[int, str]) -> str:
    if isinstance(params, torch.Tensor):
        params = [params]
    if not isinstance(params, (list, tuple)):
        return f"an iterator of parameters ({_kind(params)}; not read here, so not compared)"
    listed = ", ".join(f"`{names.get(id(p), '(a tensor outside the model)')}`" for p in params)
    return bounded(f"{len(params)} parameters: {listed}")


def _scheduler_state(lr_scheduler: Any) -> list[Entry]:
    state_dict = getattr(lr_scheduler, "state_dict", None)
    if not callable(state_dict):
        return []
    try:
        state = state_dict()
    except Exception:  # noqa: BLE001 - a scheduler that cannot describe itself is compared by type only
        return []
    if not isinstance(state, Mapping):
        return []
    return [(f"lr_scheduler.{key}", canonical(state[key])) for key in sorted(state, key=str)]


def _model_parameters(model_parameters: Optional[list[Any]], names: Mapping[int, str]) -> list[Entry]:
    if model_parameters is None:
        return [("model_parameters", "none (every parameter of the model)")]
    if all(isinstance(p, torch.Tensor) for p in model_parameters):
        return [("model_parameters", _param_list(model_parameters, names))]
    groups = [g if isinstance(g, Mapping) else {"params": g} for g in model_parameters]
    return _groups("model_parameters", groups, names)
