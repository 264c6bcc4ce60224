"""The engine's state as torch ``Stateful`` objects that DCP saves and loads.

Each object's ``state_dict()`` is a flat dict of what goes to the tensor files
(:class:`~.storage.FlatChunks` for a parameter's elements this rank owns,
plain tensors otherwise); ``load_state_dict()`` runs once DCP has read every
tensor and puts the values where the engine keeps them.  What needs a
collective (writing a stage-3 partitioned parameter) is kept in ``finalize``
and run only after every rank has read successfully.

Keys, all independent of world size and stage (that is what makes a
checkpoint reshardable):

* ``model/master/NAME``: fp32 master value of trainable parameter NAME,
  flattened to 1-D; each rank writes the ``[start, end)`` ranges it owns;
* ``model/module/NAME``: a non-trainable entry (buffer, frozen parameter),
  full, in the module's dtype, written by one rank (rank 0's buffers; a
  stage-3 partitioned frozen parameter by rank ``i % N`` after a gather);
* ``optim/NAME/KEY``: optimizer state KEY of NAME (``exp_avg``...), chunked
  like the master when it is per-element, else one replicated tensor (``step``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..zero.base import ParamShard
from ..zero.gathered import GatheredParameters
from ..zero.params import is_partitioned
from .codec import Decoder, Encoder
from .errors import CheckpointError
from .storage import FlatChunks

__all__ = [
    "ModelNames", "ModelState", "OptimizerState", "Sources", "TensorState",
    "describe_shards", "gather_partitioned", "group_shards",
]

Action = Callable[[], None]


class TensorState:
    """A DCP ``Stateful``: tensors to save or fill, and what to do once they are filled.

    ``after_load`` runs inside ``load_state_dict`` (local work only);
    ``finalize`` holds collective work for after every rank has loaded.
    """

    def __init__(self, tensors: Optional[dict[str, Any]] = None) -> None:
        self.tensors: dict[str, Any] = tensors if tensors is not None else {}
        self.after_load: list[Action] = []
        self.finalize: list[Action] = []

    def state_dict(self) -> dict[str, Any]:
        return self.tensors

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for action in self.after_load:
            action()


@dataclass
class ModelNames:
    """The module's ``state_dict`` keys; tied entries (one tensor, several names) map to the first name.

    ``tensors`` are the live objects (``keep_vars``): never read a partitioned
    one outside :class:`GatheredParameters`.
    """

    keys: list[str]
    aliases: dict[str, str]
    tensors: dict[str, torch.Tensor]

    @classmethod
    def of(cls, module: nn.Module) -> "ModelNames":
        state = module.state_dict(keep_vars=True)
        first: dict[int, str] = {}
        aliases: dict[str, str] = {}
        for name, tensor in state.items():
            if id(tensor) in first:
                aliases[name] = first[id(tensor)]
            else:
                first[id(tensor)] = name
        return cls(list(state), aliases, {n: t for n, t in state.items() if n not in aliases})

    @property
    def canonical(self) -> list[str]:
        return [k for k in self.keys if k not in self.aliases]

    def frozen(self, trainable: set[str]) -> list[str]:
        """Canonical names that are not trainable parameters (buffers, frozen parameters)."""
        return [k for k in self.canonical if k not in trainable]


def group_shards(shards: list[ParamShard]) -> dict[str, list[ParamShard]]:
    grouped: dict[str, list[ParamShard]] = {}
    for shard in shards:
        grouped.setdefault(shard.name, []).append(shard)
    return grouped


def _numel(shape: Any) -> int:
    return math.prod(shape)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _master_chunks(pieces: list[ParamShard]) -> FlatChunks:
    return FlatChunks(_numel(pieces[0].shape), [(s.start, s.master.reshape(-1)) for s in pieces])


def _is_elementwise(value: Any, shard: ParamShard) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == shard.end - shard.start


def _state_entry(value: Any, shard: ParamShard) -> dict[str, Any]:
    """How optimizer state ``value`` of ``shard`` is stored: chunked, one tensor, or a plain value."""
    if _is_elementwise(value, shard):
        return {"kind": "chunked", "dtype": _dtype_name(value.dtype)}
    if isinstance(value, torch.Tensor):
        return {"kind": "tensor", "shape": list(value.shape), "dtype": _dtype_name(value.dtype)}
    encoder = Encoder("unused")
    encoded = encoder.encode(value, f"optimizer state of `{shard.name}`")
    if encoder.tensors:
        raise CheckpointError(
            f"optimizer state of `{shard.name}` holds tensors inside a {type(value).__name__}; only tensors "
            "and plain values are supported as optimizer state entries"
        )
    return {"kind": "value", "value": encoded}


def describe_shards(shards: list[ParamShard], optimizer_state: Optional[Any]) -> dict[str, Any]:
    """What this rank holds of each trainable parameter and its optimizer state (JSON).

    ``optimizer_state`` is the inner optimizer's ``state`` (per-parameter dicts), or None.
    """
    params: dict[str, Any] = {}
    state: dict[str, Any] = {}
    for shard in shards:
        params[shard.name] = {"shape": list(shard.shape), "group": shard.group}
        entries = optimizer_state.get(shard.key, {}) if optimizer_state is not None else {}
        if entries:
            state[shard.name] = {k: _state_entry(v, shard) for k, v in entries.items()}
    return {"params": params, "state": state}


def gather_partitioned(names: ModelNames, frozen: list[str], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Full copies of the stage-3 partitioned entries among ``frozen`` that ``rank`` writes (collective).

    Entry ``i`` of them is written by rank ``i % world``, so no rank holds
    more than its share; every rank must call this with the same names.
    """
    owned: dict[str, torch.Tensor] = {}
    partitioned = [n for n in frozen if is_partitioned(names.tensors[n])]
    for index, name in enumerate(partitioned):
        param = names.tensors[name]
        with GatheredParameters([param]):
            if index % world == rank:
                owned[name] = param.detach().clone()
    return owned


# ------------------------------------------------------------------ model


class ModelState(TensorState):
    """The model's weights: fp32 masters of trainable parameters, module values of the rest."""

    @classmethod
    def saving(
        cls, names: ModelNames, shards: list[ParamShard], trainable: set[str], gathered: dict[str, torch.Tensor], rank: int
    ) -> "ModelState":
        state = cls()
        for name, pieces in group_shards(shards).items():
            state.tensors[f"master/{name}"] = _master_chunks(pieces)
        for name in names.frozen(trainable):
            live = names.tensors[name]
            if name in gathered:
                state.tensors[f"module/{name}"] = gathered[name]
            elif rank == 0 and not is_partitioned(live):
                state.tensors[f"module/{name}"] = live.detach()  # rank 0's buffers, as DDP keeps them
        return state

    @classmethod
    def loading(
        cls, names: ModelNames, shards: list[ParamShard], manifest: dict[str, Any], trainable: set[str]
    ) -> "ModelState":
        """Read every entry into where it lives now (a master piece or the module), by name."""
        sources = Sources(manifest)
        state = cls()
        for name, pieces in group_shards(shards).items():
            state._into_master(pieces, sources, sources.find(name))
        writes: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name in names.frozen(trainable):
            state._into_module(names.tensors[name], sources.find(name), sources, writes)
        if writes:
            state.finalize.append(lambda: _write_partitioned(writes, shards))
        return state

    @classmethod
    def for_module_load_fn(
        cls, module: nn.Module, shards: list[ParamShard], manifest: dict[str, Any], fn: Callable[..., Any]
    ) -> "ModelState":
        """Read the whole saved ``state_dict``, hand it to ``fn(state_dict, module)``, then take the
        master weights from the module's parameters as ``fn`` left them."""
        state = cls()
        full: dict[str, torch.Tensor] = {}
        for name, info in manifest["params"].items():
            full[name] = state.tensors[f"master/{name}"] = torch.empty(_numel(info["shape"]), dtype=torch.float32)
        for name, info in manifest["module"].items():
            full[name] = state.tensors[f"module/{name}"] = torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))

        def call() -> None:
            params = manifest["params"]
            shaped = {n: (t.view(params[n]["shape"]) if n in params else t) for n, t in full.items()}
            state_dict = {k: shaped[manifest["aliases"].get(k, k)] for k in manifest["state_dict_keys"]}
            live = dict(module.named_parameters())
            # Stage 3: the module's parameters are full inside the block; rank 0's result is kept.
            with GatheredParameters(list(live.values()), modifier_rank=0), torch.no_grad():
                fn(state_dict, module)
                for shard in shards:
                    shard.master.reshape(-1).copy_(live[shard.name].detach().reshape(-1)[shard.start : shard.end])

        state.finalize.append(call)
        return state

    def _reserve(self, key: str, value: Any) -> None:
        if key in self.tensors:
            raise CheckpointError(
                f"two entries of this model load from the checkpoint's `{key.split('/', 1)[1]}` (tied there, "
                "separate here); load it with `module_load_fn` to decide how"
            )
        self.tensors[key] = value

    def _into_master(self, pieces: list[ParamShard], sources: "Sources", source: Optional[tuple[str, str]]) -> None:
        if source is None:
            return  # reported as missing by `Sources.report`
        kind, saved = source
        if kind == "master":
            self._reserve(f"master/{saved}", _master_chunks(pieces))
            return
        # Frozen when saved, trainable now: read the module value, then slice out our pieces.
        buffer = torch.empty(pieces[0].shape, dtype=getattr(torch, sources.module[saved]["dtype"]))
        self._reserve(f"module/{saved}", buffer)

        def copy() -> None:
            flat = buffer.reshape(-1)
            for s in pieces:
                s.master.reshape(-1).copy_(flat[s.start : s.end])

        self.after_load.append(copy)

    def _into_module(
        self,
        live: torch.Tensor,
        source: Optional[tuple[str, str]],
        sources: "Sources",
        writes: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        if source is None:
            return
        kind, saved = source
        partitioned = is_partitioned(live)
        if kind == "module" and not partitioned:
            self._reserve(f"module/{saved}", live.detach())  # DCP copies (and casts) in place
            return
        if kind == "module":
            buffer = torch.empty(live.shape, dtype=getattr(torch, sources.module[saved]["dtype"]))
        else:
            buffer = torch.empty(live.shape.numel(), dtype=torch.float32)  # trainable when saved, frozen now
        self._reserve(f"{kind}/{saved}", buffer)
        if partitioned:
            writes.append((live, buffer))
        else:
            self.after_load.append(lambda: live.detach().copy_(buffer.view(live.shape)))


def _write_partitioned(writes: list[tuple[torch.Tensor, torch.Tensor]], shards: list[ParamShard]) -> None:
    """Give stage-3 partitioned (frozen) parameters new full values (collective).

    Writing through ``GatheredParameters(modifier_rank=0)`` also refreshes
    the master weights of trainable parameters stored in the same unit, from
    the unit's compute-dtype values: keep the loaded masters and put them back.
    """
    loaded = [shard.master.detach().clone() for shard in shards]
    for param, value in writes:
        with GatheredParameters([param], modifier_rank=0), torch.no_grad():
            param.copy_(value.view(param.shape))
    for shard, master in zip(shards, loaded):
        shard.master.detach().copy_(master)


class Sources:
    """Where each entry of the current model comes from in a checkpoint (tied names resolved)."""

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.params = manifest["params"]
        self.module = manifest["module"]
        self.aliases = manifest["aliases"]

    def find(self, name: str) -> Optional[tuple[str, str]]:
        saved = self.aliases.get(name, name)
        if saved in self.params:
            return ("master", saved)
        if saved in self.module:
            return ("module", saved)
        return None

    def shape(self, source: tuple[str, str]) -> list[int]:
        kind, saved = source
        return list((self.params if kind == "master" else self.module)[saved]["shape"])

    def report(self, names: ModelNames, trainable: dict[str, list[int]]) -> tuple[list[str], list[str], list[str]]:
        """``(missing, unexpected, mismatched)`` entries of the current model against the checkpoint."""
        current = {n: list(names.tensors[n].shape) for n in names.frozen(set(trainable))}
        current.update(trainable)
        used: set[str] = set()
        missing, mismatched = [], []
        for name, shape in current.items():
            source = self.find(name)
            if source is None:
                missing.append(name)
                continue
            used.add(source[1])
            if self.shape(source) != shape:
                mismatched.append(f"{name}: checkpoint {tuple(self.shape(source))}, model {tuple(shape)}")
        unexpected = sorted((set(self.params) | set(self.module)) - used)
        return sorted(missing), unexpected, mismatched


# -------------------------------------------------------------- optimizer


class OptimizerState(TensorState):
    """Per-parameter optimizer state (Adam's moments and step, SGD's momentum, ...)."""

    @classmethod
    def saving(cls, optimizer_state: Any, shards: list[ParamShard]) -> "OptimizerState":
        state = cls()
        for name, pieces in group_shards(shards).items():
            numel = _numel(pieces[0].shape)
            for shard in pieces:
                for key, value in optimizer_state.get(shard.key, {}).items():
                    fqn = f"{name}/{key}"
                    if _is_elementwise(value, shard):
                        chunks = state.tensors.setdefault(fqn, FlatChunks(numel, []))
                        chunks.pieces.append((shard.start, value.detach().reshape(-1)))
                    elif isinstance(value, torch.Tensor):
                        state.tensors.setdefault(fqn, value.detach())
        return state

    @classmethod
    def loading(
        cls, optimizer_state: Any, shards: list[ParamShard], saved_state: dict[str, Any], aliases: dict[str, str]
    ) -> "OptimizerState":
        """Fresh tensors for every saved entry, installed in ``optimizer_state`` once read.

        Pieces whose parameter has no saved state (the optimizer had not
        stepped it) end up with empty state, as in a fresh optimizer.
        """
        state = cls()

        def clear() -> None:
            for shard in shards:
                optimizer_state.pop(shard.key, None)

        state.after_load.append(clear)
        for name, pieces in group_shards(shards).items():
            saved = aliases.get(name, name)
            for shard in pieces:
                if saved_state.get(saved):
                    state._plan(optimizer_state, saved, shard, saved_state[saved])
        return state

    def _plan(self, optimizer_state: Any, saved: str, shard: ParamShard, entries: dict[str, Any]) -> None:
        numel = _numel(shard.shape)
        values: dict[str, Any] = {}
        shared: set[str] = set()
        for key, entry in entries.items():
            fqn = f"{saved}/{key}"
            dtype = getattr(torch, entry.get("dtype", "float32"))
            if entry["kind"] == "chunked":
                buffer = torch.empty(shard.end - shard.start, dtype=dtype, device=shard.master.device)
                self.tensors.setdefault(fqn, FlatChunks(numel, [])).pieces.append((shard.start, buffer))
                values[key] = buffer.view(shard.key.shape)
            elif entry["kind"] == "tensor":
                values[key] = self.tensors.setdefault(fqn, torch.empty(entry["shape"], dtype=dtype))
                shared.add(key)
            else:
                values[key] = Decoder({}).decode(entry["value"], f"optimizer state of `{saved}`")

        def install() -> None:
            # A replicated tensor (Adam's `step`) was read once: each piece gets its own copy,
            # as torch.optim would have made it.
            optimizer_state[shard.key] = {k: (v.clone() if k in shared else v) for k, v in values.items()}

        self.after_load.append(install)
