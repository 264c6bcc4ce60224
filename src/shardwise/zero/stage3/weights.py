"""``zero.load_state_dict``: full weights into a partitioned model, one unit at a time.

Rank 0 reads the source lazily (a safetensors file tensor by tensor, a ``torch.save`` file memory-mapped),
assembles one unit's full fp32 values at a time and scatters them: peak memory is about one unit on rank 0,
one slice elsewhere.  Parameters that are not partitioned, and buffers, are broadcast one by one.  The source
is a ``state_dict``, a ``.safetensors`` file (tied names stored once are found under any of their names), a
``*.safetensors.index.json`` or a ``.pt``/``.bin`` file.  Collective: every rank calls it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ...comm.distributed import Comm
from ...faults.announce import Announcer, register
from ...faults.ledger import doing
from .params import Unit, unit_of

__all__ = ["LoadResult", "load_state_dict"]

StateSource = Union[Mapping[str, torch.Tensor], str, "os.PathLike[str]"]


class LoadResult(NamedTuple):
    """Names in the module the source lacks, and names in the source the module lacks."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class _Reader:
    """Rank 0's view of the source: names, shapes, and one tensor at a time."""

    def __init__(self, source: StateSource) -> None:
        self._files: dict[str, Any] = {}
        self._where: dict[str, tuple[str, str]] = {}  # name -> (file, name stored in it)
        self._state: Optional[Mapping[str, torch.Tensor]] = None
        if isinstance(source, Mapping):
            self._state = source
            self._where = {k: ("", k) for k in source}
        else:
            self._open(Path(source))

    def _open(self, path: Path) -> None:
        if not path.is_file():
            raise FileNotFoundError(f"zero.load_state_dict: {path} is not a file; pass a state_dict or a "
                                    "`.safetensors`, `.safetensors.index.json`, `.pt` or `.bin` file")
        if path.name.endswith(".index.json"):
            shards = json.loads(path.read_text())["weight_map"]
            for name, file in shards.items():
                self._open_safetensors(path.parent / file, only=name)
        elif path.suffix == ".safetensors":
            self._open_safetensors(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            self._files[str(path)] = state
            self._where.update({k: (str(path), k) for k in state})

    def _open_safetensors(self, path: Path, only: Optional[str] = None) -> None:
        from safetensors import safe_open  # here: only a `.safetensors` source needs it

        key = str(path)
        if key not in self._files:
            self._files[key] = safe_open(key, framework="pt")
        handle = self._files[key]
        stored = list(handle.keys())
        for name in stored if only is None else [only]:
            self._where[name] = (key, name)
        if only is None:  # shardwise's consolidated export stores tied names once
            aliases = json.loads((handle.metadata() or {}).get("shardwise_aliases", "{}"))
            self._where.update({alias: (key, name) for alias, name in aliases.items() if name in stored})

    def shapes(self) -> dict[str, list[int]]:
        return {name: list(self._tensor_shape(name)) for name in self._where}

    def _tensor_shape(self, name: str) -> torch.Size:
        file, stored = self._where[name]
        if self._state is not None:
            return self._state[stored].shape
        handle = self._files[file]
        if isinstance(handle, Mapping):
            return handle[stored].shape
        return torch.Size(handle.get_slice(stored).get_shape())

    def get(self, name: str) -> torch.Tensor:
        file, stored = self._where[name]
        if self._state is not None:
            return self._state[stored]
        handle = self._files[file]
        return handle[stored] if isinstance(handle, Mapping) else handle.get_tensor(stored)


@dataclass
class _Plan:
    """What every rank agrees on before anything moves: which module names come from which source names."""

    found: dict[str, str]  # module name -> source name
    missing: list[str]
    unexpected: list[str]


def _plan(module: nn.Module, shapes: dict[str, list[int]]) -> _Plan:
    state = module.state_dict(keep_vars=True)
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in state.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    found, missing, mismatched = {}, [], []
    for names in by_tensor.values():
        source = next((n for n in names if n in shapes), None)  # a tied tensor may be stored under any name
        if source is None:
            missing.extend(names)
            continue
        with torch._C.DisableTorchFunctionSubclass():
            shape = list(state[names[0]].shape)
        if shapes[source] != shape:
            mismatched.append(f"`{source}`: source {tuple(shapes[source])}, model {tuple(shape)}")
        found.update({n: source for n in names})
    if mismatched:
        raise ValueError(f"zero.load_state_dict: shapes differ for {mismatched}; load weights of the same "
                         "architecture, or fix the names with a mapped state_dict")
    # a source name that is any of the model's names is expected (tied names may all be stored)
    return _Plan(found, sorted(missing), sorted(set(shapes) - set(state)))


def load_state_dict(module: nn.Module, state_dict_or_path: StateSource, strict: bool = True,
                    process_group: Optional[dist.ProcessGroup] = None) -> LoadResult:
    """Load full weights into ``module`` (partitioned by ``zero.Init`` or a stage-3 engine, or plain), one unit at a
    time; collective (see the module docstring).  With ``strict`` (default) a missing or unexpected name is an error,
    raised on every rank before anything changes.  Returns the missing and unexpected names."""
    units = [unit for p in module.parameters() if (unit := unit_of(p)) is not None]
    comm = units[0].comm if units else Comm(process_group)
    owner = f"a `{type(module).__name__}`"
    # collective: announced first, so a rank loading alone raises with the others before anything moves
    with doing("zero.load_state_dict", owner), Announcer(comm, owner, engine=False).scope("zero.load_state_dict"):
        reader = _Reader(state_dict_or_path) if comm.rank == 0 else None
        shapes = comm.broadcast_object(reader.shapes() if reader is not None else None)
        plan = _plan(module, shapes)
        if strict and (plan.missing or plan.unexpected):
            raise ValueError(
                f"zero.load_state_dict: missing keys (in the model, not the source): {plan.missing}; unexpected "
                f"keys (in the source, not the model): {plan.unexpected}. Pass `strict=False` to load what both have")
        _load_units(module, comm, reader, plan)
        _load_plain(module, comm, reader, plan)
        return LoadResult(plan.missing, plan.unexpected)


def _load_units(module: nn.Module, comm: Comm, reader: Optional[_Reader], plan: _Plan) -> None:
    units: dict[int, tuple[Unit, dict[int, str]]] = {}  # every partitioned unit once, its parameters' names by index
    for name, param in module.named_parameters(remove_duplicate=False):
        if (unit := unit_of(param)) is not None:
            units.setdefault(id(unit), (unit, {}))[1].setdefault(param.__dict__["_shardwise_index"], name)
    for unit, names in units.values():
        loaded = {index for index, name in names.items() if name in plan.found}
        if not loaded:
            continue
        partial, was_gathered = len(loaded) < len(unit.params), unit.gathered
        if partial:
            unit.ensure_gathered()  # parameters the source lacks keep their current values
        values = torch.empty(unit.shard_numel, dtype=torch.float32, device=unit.device)
        pieces = _full_values(unit, names, loaded, reader, plan) if reader is not None else None
        comm.scatter(values, pieces, src=0)
        if partial and not was_gathered:
            unit.free()
        unit.owner.on_values_loaded(unit, values, loaded)  # first: a wide shard (the masters) is written there
        unit.load_shard(values)
        unit.shard_released()  # done with it: a shard kept in a file may leave host memory (`max_in_cpu`)


def _full_values(unit: Unit, names: dict[int, str], loaded: set[int], reader: _Reader,
                 plan: _Plan) -> list[torch.Tensor]:
    """Rank 0: the unit's full fp32 values (one unit in memory), cut into the ranks' slices."""
    flat = torch.zeros(unit.padded, dtype=torch.float32, device=unit.device)
    with torch._C.DisableTorchFunctionSubclass():
        for index in range(len(unit.params)):
            target = unit.param_view(flat, index)
            if index in loaded:
                target.copy_(reader.get(plan.found[names[index]]))
            else:
                target.copy_(unit.param_view(unit.full, index))
    return list(flat.chunk(unit.comm.world_size))


def _load_plain(module: nn.Module, comm: Comm, reader: Optional[_Reader], plan: _Plan) -> None:
    """Parameters that are not partitioned, and buffers: broadcast from rank 0, one at a time."""
    done: set[int] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if unit_of(tensor) is not None or id(tensor) in done or name not in plan.found:
            continue
        done.add(id(tensor))
        value = reader.get(plan.found[name]).to(tensor.dtype) if reader is not None else torch.empty_like(tensor)
        comm.broadcast(value, src=0)
        with torch.no_grad():
            tensor.copy_(value)


register("load_state_dict", "zero.load_state_dict")
