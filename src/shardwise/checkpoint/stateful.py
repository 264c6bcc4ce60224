"""The engine's state as torch ``Stateful`` objects that DCP saves and loads, and each rank's RNG states.

A ``state_dict()`` is a flat dict of what goes to the tensor files.  Loading reads into *fresh* tensors only; what to do
with them is kept in ``actions``, run by the load once every rank has read and checked everything. Keys are independent
of world size and stage, which makes a checkpoint reshardable (``docs/checkpoints.md``, "On-disk layout", lists them).
"""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..optim.param_state import ParamShard, is_per_element
from .codec import Decoder, Encoder, dtype_name
from .files import CheckpointError
from .storage import FlatChunks

__all__ = [
    "ModelNames", "ModelState", "OptimizerState", "Sources", "TensorState", "capture_rng", "describe_shards",
    "restore_rng",
]


class TensorState:
    """A DCP ``Stateful``: the tensors to save or to fill, and what to do once they are filled."""

    def __init__(self, tensors: Optional[dict[str, Any]] = None) -> None:
        self.tensors: dict[str, Any] = tensors if tensors is not None else {}
        #: local work that puts loaded values in place, run by the load after validation
        self.actions: list[Callable[[], None]] = []

    def state_dict(self) -> dict[str, Any]:
        return self.tensors

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """DCP filled ``tensors`` in place; applying them is the load's decision, later."""

    def apply(self) -> None:
        for action in self.actions:
            action()


@dataclass
class ModelNames:
    """The module's ``state_dict`` keys; tied entries (one tensor, several names) map to the first name.
    ``tensors`` are the live objects, read for their metadata only (values go through the engine)."""

    keys: list[str]
    aliases: dict[str, str]
    tensors: dict[str, torch.Tensor]

    @classmethod
    def of(cls, module: nn.Module) -> "ModelNames":
        state = module.state_dict(keep_vars=True)
        first: dict[int, str] = {}
        for name, tensor in state.items():
            first.setdefault(id(tensor), name)
        aliases = {name: first[id(tensor)] for name, tensor in state.items() if first[id(tensor)] != name}
        return cls(list(state), aliases, {n: t for n, t in state.items() if n not in aliases})

    def others(self, with_master: set[str]) -> list[str]:
        """Canonical names that have no master (buffers, frozen parameters without kept state)."""
        return [k for k in self.keys if k not in self.aliases and k not in with_master]

    def live(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self.tensors[n] for n in names}


def _by_name(shards: list[ParamShard]) -> dict[str, list[ParamShard]]:
    grouped: dict[str, list[ParamShard]] = {}
    for shard in shards:
        grouped.setdefault(shard.name, []).append(shard)
    return grouped


def _state_entry(value: Any, shard: ParamShard) -> dict[str, Any]:
    """How optimizer state ``value`` of ``shard`` is stored: chunked, one tensor, or a plain value."""
    if is_per_element(value, shard.numel):
        return {"kind": "chunked", "dtype": dtype_name(value.dtype)}
    if isinstance(value, torch.Tensor):
        return {"kind": "tensor", "shape": list(value.shape), "dtype": dtype_name(value.dtype)}
    encoder = Encoder("unused")
    encoded = encoder.encode(value, f"optimizer state of `{shard.name}`")
    if encoder.tensors:
        raise CheckpointError(
            f"optimizer state of `{shard.name}` holds tensors inside a {type(value).__name__}; only tensors "
            "and plain values are supported as optimizer state entries"
        )
    return {"kind": "value", "value": encoded}


def describe_shards(shards: list[ParamShard]) -> dict[str, Any]:
    """What this rank holds of each parameter with a master, and of its optimizer state (JSON)."""
    params = {shard.name: {"shape": list(shard.shape), "group": shard.group} for shard in shards}
    state = {s.name: {k: _state_entry(v, s) for k, v in entries.items()} for s in shards if (entries := s.state.get())}
    return {"params": params, "state": state}


class ModelState(TensorState):
    """The model's weights: fp32 masters of parameters that have them, module values of the rest."""

    @classmethod
    def saving(cls, shards: list[ParamShard], entries: dict[str, torch.Tensor]) -> "ModelState":
        """``entries``: the full module values this rank writes (from the engine's ``save_entries``)."""
        state = cls()
        for name, pieces in _by_name(shards).items():
            chunks = [(s.start, s.master.reshape(-1)) for s in pieces]
            state.tensors[f"master/{name}"] = FlatChunks(math.prod(pieces[0].shape), chunks)
        state.tensors.update({f"module/{name}": value for name, value in entries.items()})
        return state

    @classmethod
    def loading(cls, shards: list[ParamShard], sources: Sources, buffers: dict[str, torch.Tensor]) -> ModelState:
        """Read every entry, by name, into fresh tensors; ``buffers`` are the engine's module-entry
        targets (from ``load_entries``), filled here and applied by the engine."""
        state = cls()
        for name, pieces in _by_name(shards).items():
            state._into_master(pieces, sources, sources.find(name))
        for name, buffer in buffers.items():
            state._into_entry(buffer, sources.find(name), sources)
        return state

    @classmethod
    def whole(cls, manifest: dict[str, Any]) -> tuple[ModelState, dict[str, torch.Tensor]]:
        """The whole saved ``state_dict`` (for ``module_load_fn``), tied names sharing one tensor."""
        state = cls()
        full: dict[str, torch.Tensor] = {}
        for name, info in manifest["params"].items():
            state.tensors[f"master/{name}"] = torch.empty(math.prod(info["shape"]), dtype=torch.float32)
            full[name] = state.tensors[f"master/{name}"].view(info["shape"])
        for name, info in manifest["module"].items():
            full[name] = state.tensors[f"module/{name}"] = torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
        state_dict = {k: full[manifest["aliases"].get(k, k)] for k in manifest["state_dict_keys"]}
        return state, state_dict

    def _reserve(self, key: str, value: Any) -> None:
        if key in self.tensors:
            raise CheckpointError(
                f"two entries of this model load from the checkpoint's `{key.split('/', 1)[1]}` (tied there, "
                "separate here); load it with `module_load_fn` to decide how"
            )
        self.tensors[key] = value

    def _into_master(self, pieces: list[ParamShard], sources: Sources, source: Optional[tuple[str, str]]) -> None:
        if source is None:
            return  # reported as missing by `Sources.report`
        kind, saved = source
        if kind == "master":
            read = [torch.empty(s.numel, dtype=torch.float32, device=s.master.device) for s in pieces]
            chunks = FlatChunks(math.prod(pieces[0].shape), [(s.start, r) for s, r in zip(pieces, read)])
            self._reserve(f"master/{saved}", chunks)

            def copy_masters() -> None:
                for shard, values in zip(pieces, read):
                    shard.master.reshape(-1).copy_(values)

            self.actions.append(copy_masters)
            return
        # Saved without a master (frozen then), has one now: read the module value, slice out our pieces.
        buffer = torch.empty(pieces[0].shape, dtype=getattr(torch, sources.module[saved]["dtype"]))
        self._reserve(f"module/{saved}", buffer)

        def copy() -> None:
            flat = buffer.reshape(-1)
            for s in pieces:
                s.master.reshape(-1).copy_(flat[s.start : s.end])

        self.actions.append(copy)

    def _into_entry(self, buffer: torch.Tensor, source: Optional[tuple[str, str]], sources: Sources) -> None:
        if source is None:
            return
        kind, saved = source
        if kind == "module":
            self._reserve(f"module/{saved}", buffer)  # DCP copies (and casts) into it
            return
        master = torch.empty(buffer.numel(), dtype=torch.float32)  # had a master when saved, has none now
        self._reserve(f"master/{saved}", master)

        def copy() -> None:
            buffer.copy_(master.view(buffer.shape))

        self.actions.append(copy)


class Sources:
    """Where each entry of the current model comes from in a checkpoint (tied names resolved)."""

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.params, self.module, self.aliases = manifest["params"], manifest["module"], manifest["aliases"]

    def find(self, name: str) -> Optional[tuple[str, str]]:
        saved = self.aliases.get(name, name)
        if saved in self.params:
            return ("master", saved)
        if saved in self.module:
            return ("module", saved)
        return None

    def report(self, names: ModelNames, with_master: dict[str, list[int]]) -> tuple[list[str], list[str], list[str]]:
        """``(missing, unexpected, mismatched)`` entries of the current model against the checkpoint."""
        current = {n: list(names.tensors[n].shape) for n in names.others(set(with_master))}
        current.update(with_master)
        used: set[str] = set()
        missing, mismatched = [], []
        for name, shape in current.items():
            source = self.find(name)
            if source is None:
                missing.append(name)
                continue
            kind, saved = source
            used.add(saved)
            saved_shape = list((self.params if kind == "master" else self.module)[saved]["shape"])
            if saved_shape != shape:
                mismatched.append(f"{name}: checkpoint {tuple(saved_shape)}, model {tuple(shape)}")
        unexpected = sorted((set(self.params) | set(self.module)) - used)
        return sorted(missing), unexpected, mismatched


class OptimizerState(TensorState):
    """Per-parameter optimizer state (Adam's moments and step, SGD's momentum, ...)."""

    @classmethod
    def saving(cls, shards: list[ParamShard]) -> OptimizerState:
        state = cls()
        for name, pieces in _by_name(shards).items():
            numel = math.prod(pieces[0].shape)
            for shard in pieces:
                for key, value in shard.state.get().items():
                    fqn = f"{name}/{key}"
                    if is_per_element(value, shard.numel):
                        chunks = state.tensors.setdefault(fqn, FlatChunks(numel, []))
                        chunks.pieces.append((shard.start, value.detach().reshape(-1)))
                    elif isinstance(value, torch.Tensor):
                        state.tensors.setdefault(fqn, value.detach())
        return state

    @classmethod
    def loading(cls, shards: list[ParamShard], saved_state: dict[str, Any], aliases: dict[str, str]) -> OptimizerState:
        """Fresh tensors for every saved entry, installed through each shard's slot when applied; a parameter
        with no saved state (never stepped) gets empty state, as in a fresh optimizer."""
        state = cls()
        for name, pieces in _by_name(shards).items():
            saved = aliases.get(name, name)
            for shard in pieces:
                state._plan(saved, shard, saved_state.get(saved) or {})
        return state

    def _plan(self, saved: str, shard: ParamShard, entries: dict[str, Any]) -> None:
        numel = math.prod(shard.shape)
        values: dict[str, Any] = {}
        shared: set[str] = set()
        for key, entry in entries.items():
            fqn = f"{saved}/{key}"
            dtype = getattr(torch, entry.get("dtype", "float32"))
            if entry["kind"] == "chunked":
                buffer = torch.empty(shard.numel, dtype=dtype, device=shard.master.device)
                self.tensors.setdefault(fqn, FlatChunks(numel, [])).pieces.append((shard.start, buffer))
                values[key] = buffer
            elif entry["kind"] == "tensor":
                values[key] = self.tensors.setdefault(fqn, torch.empty(entry["shape"], dtype=dtype))
                shared.add(key)
            else:
                values[key] = Decoder({}).decode(entry["value"], f"optimizer state of `{saved}`")
        # a replicated tensor (Adam's `step`) was read once: each piece gets its own copy, as in torch.optim
        self.actions.append(lambda: shard.state.set({k: (v.clone() if k in shared else v) for k, v in values.items()}))


# -------------------------------------------------------------------- RNG


def capture_rng() -> dict[str, Any]:
    """This process's RNG states, as plain values and tensors."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # only if the program uses numpy: never import it for this
        state["numpy"] = numpy.random.get_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set the RNG states :func:`capture_rng` returned (the parts this process has)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    numpy = sys.modules.get("numpy")
    if "numpy" in state and numpy is not None:
        name, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss, cached))
