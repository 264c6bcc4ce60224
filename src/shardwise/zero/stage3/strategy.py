"""Stage 3: parameters, gradients, master weights and optimizer state all sharded (docs/stage3.md).

Layout.  Every module's *direct* floating-point parameters form one :class:`~.params.Unit` (a flat buffer
padded to a multiple of N; rank ``r`` keeps slice ``r``, in fp32 unless it or the state is offloaded).  Units of at most
``stage3_param_persistence_threshold`` elements are merged into one *persistent* unit that stays gathered.  A
tied parameter belongs to the first module that holds it; every module holding it gathers that unit.

Gradients.  Autograd writes full-size gradients into ``param.grad``; between accumulation boundaries they
accumulate there.  At a boundary (``sync``), once every trainable parameter of a unit has its gradient, the
unit's gradients are copied into one fp32 flat tensor and reduce-scattered (asynchronously, a couple in
flight); the result, divided by N, is added to the pieces' gradients (allocated by the first reduction after
``zero_grad``, dropped by it) and ``param.grad`` is released.  Units are reduced in a fixed order (reverse
order of first use in forward, then the rest), so all ranks issue the same collectives in the same order.

Masters and step.  The pieces, their masters and optimizer state are the master store's (:mod:`..store`, its
home chosen once); its model side is :class:`UnitSide`, here.  For each trainable parameter this rank owns a
*piece*: the elements ``[start, end)`` of the flattened parameter in its slice of the unit.  The inner
optimizer's param groups hold the pieces' keys in place of the parameters, so any torch optimizer steps exactly
this rank's 1/N, skipping a piece whose ``.grad`` is None (frozen, or no gradient anywhere this step).  With the
shards and state in memory the masters are views of the shards, as in torch FSDP (in fp16/bf16 too: the shards
are kept in fp32 and cast as they are sent): a step copies nothing, and the next forward gathers the new values
(only the persistent unit is re-gathered).  Otherwise (shards in a file, :mod:`..offload.shards`, where a view
would leave host memory with the shard, or the state offloaded) the masters are apart and updated ones are cast
into the shards (:meth:`UnitSide.write`).  Values written into the units outside a
step (``GatheredParameters(modifier_rank=...)``, an in-place write in a forward, ``zero.load_state_dict``)
reach the masters through this side: it is the gatherer's :class:`~.hooks.MasterValues` (:mod:`.hooks`).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Iterable, Iterator, NamedTuple, Optional, Sequence

import torch
from torch import nn

from ...comm.distributed import Comm, Work, wait_all
from ...optim.param_state import ParamShard
from ..base import Apply, Strategy, module_order, remove_with, tensor_bytes
from ..offload.shards import HostShards, ShardCache, params_home, shard_cache
from ..store import choose_home
from ..store.plan import offload_spec
from ..store.store import MasterStore, Piece, Run, Runs
from .hooks import GatheredParameters, Gatherer
from .params import Unit, UnitError, UnitState, is_partitioned, restore_parameter, unit_of

__all__ = ["InFlight", "Stage3", "UnitSide", "piece_runs", "take_grads"]

_MAX_IN_FLIGHT = 2


class InFlight(NamedTuple):
    """One unit's reduce-scatter: ``source`` (its local gradients) lives until waited for, ``output`` receives this
    rank's slice; ``trainable``: the indices of its trainable params."""

    work: Work
    unit: Unit
    source: torch.Tensor
    output: torch.Tensor
    trainable: list[int]


class Stage3(Strategy):
    """Partitioned parameters gathered by module hooks; see the module docstring."""

    stage = 3
    shards_grads = True
    gathers = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.units: list[Unit] = []
        # the store's home, chosen once: the shards are the masters unless they live in files or the state is offloaded
        self._device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
        in_files = params_home(self.zero_config, self._device) is not None
        self.side = UnitSide(self.comm.rank, in_files)
        offload = offload_spec(self.zero_config, self.comm.rank, self._device)
        fp32 = self.precision.dtype == torch.float32
        #: bf16/fp16, all in memory: the shards are kept in fp32 as the masters, cast as they are sent (`Unit.wide`)
        self._wide = not fp32 and offload is None and not in_files
        self.store = MasterStore(choose_home(self.side, offload, self._wide or (fp32 and not in_files), self._device,
                                             self.precision.dtype))
        self.side.store = self.store
        #: the shards' file and host cache (`offload_param: nvme`), or host home (cpu, on an accelerator)
        self.shards: Optional[ShardCache | HostShards] = None
        self.gatherer = Gatherer(self.module, self.units, self.zero_config, self.side, self.comm.rank)
        self._params: list[nn.Parameter] = []  # the optimizer's parameters, module order
        self._mask: tuple[bool, ...] = ()
        self._trainable: dict[Unit, list[int]] = {}  # unit -> indices of its trainable params
        #: (unit, index) of every trainable parameter, in the same order on every rank: the flags' order
        self._keys: list[tuple[Unit, int]] = []
        self._grad_hooks: dict[int, Any] = {}
        self._order: list[Unit] = []
        self._next = 0
        self._ready: set[Unit] = set()
        self._arrived: dict[Unit, set[int]] = {}
        self._works: list[InFlight] = []
        self._dirty = False
        #: (unit, index) of the trainable parameters this rank had a gradient for since `zero_grad`: summed over
        #: the ranks with the norm (:meth:`step_sums`), the step leaves those no rank had alone
        self._had: set[tuple[Unit, int]] = set()
        #: where the reduced gradients live (the flags' all-reduce must use the same device as the collectives)
        self._grad_device = torch.device("cpu")

    def attach(self, inner: Optional[Any], initial: Optional[dict[int, torch.Tensor]] = None) -> None:
        super().attach(inner, initial)
        _check_module(self.module, self.comm)
        if inner is not None:
            self._groups = [list(group["params"]) for group in inner.param_groups]
            self._params = module_order(self.module, self._groups)
        self._mask = tuple(p.requires_grad for p in self._params)
        self._build_units()
        self.initial = {}
        self.refresh_trainable()
        if inner is not None:
            self._point_optimizer()
        self.gatherer.install()

    def _build_units(self) -> None:
        group_of = {id(p): g for g, params in enumerate(self._groups) for p in params}
        threshold = int(self.zero_config.stage3_param_persistence_threshold)
        specs = unit_specs(self.module, threshold)
        world = self.comm.world_size
        bound = sum(max(1, -(-sum(p.numel() for p in params) // world)) for params, _, _ in specs)  # shard elements
        runs = piece_runs([params for params, _, _ in specs], group_of, self.comm.rank, world)
        self.store.plan(runs, sum(run.numel for run in runs), self.inner)
        self.shards = shard_cache(self.zero_config, self.comm.rank, bound, self.precision.dtype, self._device)
        for params, names, persistent in specs:
            unit = Unit(len(self.units), params, names, self.comm, self.gatherer, persistent)
            values = _initial_flat(unit, self.initial)
            unit.build(values, self.precision.dtype, self._wide)
            # after build: in fp32 `values` became the (now freed) full buffer, and the masters are the shard
            for piece in self.side.pieces(unit, group_of):
                self.store.add(piece, self.side.initial(piece, values) if piece.param.requires_grad else None)
            if self.shards is not None:
                unit.storage = self.shards.place(unit.shard, unit)  # (which took its values)
                unit.shard_released()  # it may leave host memory now
            self.units.append(unit)

    def _point_optimizer(self) -> None:
        for group, originals in zip(self.inner.param_groups, self._groups):
            group["params"] = self.store.keys_for(originals)

    def trainable_changed(self) -> bool:
        return tuple(p.requires_grad for p in self._params) != self._mask

    def refresh_trainable(self) -> None:
        """Frozen pieces leave the optimizer, unfrozen ones join it; trainable parameters get their hook
        (torch refuses hooks on frozen ones: added when unfrozen)."""
        self._mask = tuple(p.requires_grad for p in self._params)
        if self.store.refresh(self.inner.state if self.inner is not None else {}) and self.inner is not None:
            self._point_optimizer()
        self._trainable = {}
        added = []
        for param in self._params:
            unit = unit_of(param)
            if unit is not None and param.requires_grad:
                index = param.__dict__["_shardwise_index"]
                self._trainable.setdefault(unit, []).append(index)
                if id(param) not in self._grad_hooks:  # held weakly: a dropped engine is freed (`remove_with`)
                    hook = functools.partial(_on_grad, weakref.ref(self), weakref.ref(unit), index)
                    added.append(param.register_post_accumulate_grad_hook(hook))
                    self._grad_hooks[id(param)] = added[-1]
        if added:
            remove_with(self, added)
        self._keys = [(unit, index) for unit in self.units for index in self._trainable.get(unit, ())]

    def has_pending_grads(self) -> bool:
        return self._dirty

    def trained_count(self) -> int:
        return sum(len(indices) for indices in self._trainable.values())

    def run_backward(self, tensor: torch.Tensor, sync: bool, retain_graph: bool = False) -> None:
        self.start_backward(sync)
        try:
            tensor.backward(retain_graph=retain_graph)  # the hooks are called from here
        except BaseException:
            self.abort_backward()
            raise
        self.finish_backward()

    def start_backward(self, sync: bool) -> None:
        backward = self.backward
        backward.sync, backward.active, backward.arrivals = sync, True, 0
        backward.serial += 1
        self._dirty, self._arrived, self._ready, self._next = True, {}, set(), 0
        if sync:  # reverse order of first use in forward, then the units that forward did not use
            used = [u for u in reversed(list(self.gatherer.forward_order)) if u in self._trainable]
            seen = set(used)
            self._order = used + [u for u in self.units if u in self._trainable and u not in seen]

    def _on_grad(self, unit: Unit, index: int, param: torch.Tensor) -> None:
        """Parameter ``index`` of ``unit`` got its gradient: reduce the unit once all of its have."""
        backward = self.backward
        if unit not in self._trainable or not backward.active:
            return  # (not in this engine's backward: another engine's loss reached this model)
        backward.arrivals += 1
        arrived = self._arrived.setdefault(unit, set())
        arrived.add(index)
        if len(arrived) < len(self._trainable[unit]):
            return
        if backward.sync and unit not in self._ready:
            self._ready.add(unit)
            while self._next < len(self._order) and self._order[self._next] in self._ready:
                self._launch(self._order[self._next])
                self._next += 1
        if unit in self.gatherer.held_for_grads:  # a call with no post-backward holds it until now
            self.gatherer.grads_ready(unit)

    def _launch(self, unit: Unit) -> None:
        # fp32 unless `communication_data_type` halves the bytes on the wire; averaged into fp32 below
        wire = self.precision.reduce_dtype
        trainable = self._trainable[unit]
        source, had_grad = take_grads(unit, trainable, wire)
        self._had.update((unit, index) for index in had_grad)
        self._grad_device = source.device
        # one process: the reduction is the identity, and the flat gradients are the slice (no second buffer)
        output = source if not self.comm.distributed else torch.empty(unit.shard_numel, dtype=wire,
                                                                        device=source.device)
        work = self.comm.reduce_scatter(output, source, async_op=True, label=unit.label)
        self._works.append(InFlight(work, unit, source, output, trainable))
        if len(self._works) > _MAX_IN_FLIGHT:
            self._land(self._works[: -_MAX_IN_FLIGHT], False)
            del self._works[: -_MAX_IN_FLIGHT]

    def _land(self, flights: list[InFlight], last: bool) -> None:
        """Wait for ``flights`` (one call); the store adds each unit's slice to its pieces' gradients (``last``: the
        reduction is over)."""
        wait_all([flight.work for flight in flights])
        by_unit = self.side.by_unit
        reduced = [([p for p in by_unit.get(f.unit, ()) if p.index in f.trainable], f.output) for f in flights]
        self.store.add_reduced(reduced, 1.0 / self.comm.world_size, last)

    def abort_forward(self) -> None:
        self.gatherer.abort_forward()

    def abort_backward(self) -> None:
        self.backward.active = False
        self._drain()
        self._arrived, self._ready = {}, set()
        self._next = len(self._order)
        self.gatherer.abort_backward()

    def _drain(self) -> None:
        """Wait for the reduce-scatters in flight and drop them (a backward raised: not into the next step's)."""
        works, self._works = self._works, []
        for flight in works:
            flight.work.wait()

    def attach_announcer(self, announcer: Any) -> None:
        self.gatherer.announcer = announcer

    def finish_backward(self) -> None:
        self.backward.active = False
        self.gatherer.forward_order = {}
        if not self.backward.sync:
            return
        for unit in self._order[self._next :]:
            self._launch(unit)
        self._next = len(self._order)
        works, self._works = self._works, []
        self._land(works, True)

    def step_sums(self) -> torch.Tensor:
        """This rank's sum of squared gradients (taken as the reduction finished, unless written since), then
        per trainable parameter whether this rank had a gradient for it: the flags ride the norm's all-reduce
        (DDP's `find_unused_parameters` without a collective of its own)."""
        share = self.store.share
        if share is not None and all(key.grad is grad and grad._version == version for key, grad, version in share.seen):
            sq = share.sq
        else:  # written since the reduction finished (a script's own scaling, a trainability change)
            sq = self.store.grad_sq()
        flags = [float(key in self._had) for key in self._keys]
        return torch.cat([sq.reshape(1).to(self._grad_device),
                          torch.tensor(flags, dtype=torch.float32, device=self._grad_device)])

    def step(self, inner: Any, factor: float, sums: torch.Tensor, release: bool) -> None:
        self.gatherer.take_written()
        used = {key for key, count in zip(self._keys, sums.tolist()) if count > 0}
        store = self.store
        # scale, leave the pieces no rank had a gradient for alone, step, publish into the shards
        unused = [p for p in store.pieces if p.key is not None and (p.unit, p.index) not in used]
        store.step(inner, factor, unused, release)  # (and drop the gradients, if asked)
        if release:
            self._forget_grads()
        self._refresh_gathered()

    def sync_params_from_master(self) -> None:
        self.store.publish()
        self._refresh_gathered()

    def _refresh_gathered(self) -> None:
        """After a step, gathered trainable units are stale: a persistent or held one is re-gathered, others dropped."""
        for unit in self.units:
            state = unit.state
            if unit not in self._trainable or state is UnitState.SHARDED:
                continue
            if state is UnitState.PERSISTENT or unit.holders:
                unit.refresh()
            else:
                self.gatherer.drop(unit)

    def zero_grad(self) -> None:
        self._drain()  # left by a backward that raised: never added into the gradients that follow
        self._forget_grads()
        self.store.drop_grads()

    def _forget_grads(self) -> None:
        self._dirty, self._arrived, self._ready, self._had = False, {}, set(), set()
        with torch._C.DisableTorchFunctionSubclass():
            for unit in self.units:
                for param in unit.params:
                    param.grad = None

    def memory_breakdown(self) -> dict[str, int]:
        params = sum(u.storage.held_bytes() for u in self.units)  # an offloaded shard: only while in host memory
        params += sum(u.padded * u.element_bytes() for u in self.units if u.persistent)
        params += tensor_bytes([p for p in self.module.parameters() if not is_partitioned(p)])
        grads = [p.grad for p in self.store.pieces if p.grad is not None]
        with torch._C.DisableTorchFunctionSubclass():
            grads += [p.grad for u in self.units for p in u.params if p.grad is not None]
        state = getattr(self.inner, "state", {}) if self.inner is not None else {}
        return {"parameters": params, "master_weights": self.store.master_bytes(), "gradients": tensor_bytes(grads),
                "optimizer_state": self.store.state_bytes(state)}

    def full_master_weights(self) -> dict[int, torch.Tensor]:
        self.gatherer.take_written()
        result: dict[int, torch.Tensor] = {}
        for unit in self.units:
            # a copy even in fp32: `fill` writes into it, and the shard itself must not change (nor, kept in a
            # file, be marked written)
            shard = unit.shard.to(torch.float32, copy=True)
            unit.shard_released()  # only read: a shard kept in a file may leave (`max_in_cpu`)
            self.side.fill(unit, shard)
            full = torch.empty(unit.padded, dtype=torch.float32, device=shard.device)
            self.comm.all_gather(full, shard)
            for index, param in enumerate(unit.params):
                result[id(param)] = unit.param_view(full, index).clone()
        return result

    @contextlib.contextmanager
    def checkpoint_shards(self, loading: bool, wanted: frozenset[str] = frozenset()) -> Iterator[list[ParamShard]]:
        if self.shards is not None:
            self.shards.check_usable()  # a shard file that lost its state: no save or load goes on from here
        if self.inner is None:
            yield []
            return
        self.gatherer.take_written()
        with self.store.shards(self.inner.state, loading, wanted) as shards:
            yield shards
        if not loading:
            return
        for unit in self.units:  # frozen units took loaded values: drop stale gathered copies
            if unit.gathered and unit not in self._trainable:
                unit.refresh()

    def save_entries(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Partitioned entries are gathered one at a time, entry ``i`` written by rank ``i % N`` (collective)."""
        owned = super().save_entries({n: t for n, t in live.items() if not is_partitioned(t)})
        partitioned = [n for n, t in live.items() if is_partitioned(t)]
        for index, name in enumerate(partitioned):
            with GatheredParameters([live[name]]):
                if index % self.comm.world_size == self.comm.rank:
                    owned[name] = live[name].detach().clone()
        return owned

    def load_entries(self, live: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Apply]:
        buffers, apply_local = super().load_entries({n: t for n, t in live.items() if not is_partitioned(t)})
        partitioned = {n: t for n, t in live.items() if is_partitioned(t)}
        with torch._C.DisableTorchFunctionSubclass():
            buffers.update({n: torch.empty(t.shape, dtype=t.dtype, device=t.device) for n, t in partitioned.items()})

        def apply() -> None:
            apply_local()
            for name, param in partitioned.items():  # collective: rank 0's values, re-partitioned
                with GatheredParameters([param], modifier_rank=0), torch.no_grad():
                    param.copy_(buffers[name])

        return buffers, apply

    @contextlib.contextmanager
    def writable_full_params(self) -> Iterator[None]:
        with GatheredParameters(list(self.module.parameters()), modifier_rank=0):
            yield

    def close(self, restore_params: bool = True) -> None:
        """Without ``restore_params`` each parameter gets an empty storage (a model no rank could hold whole)."""
        held = [unit for unit in self.units if unit.holders]
        if held:
            raise UnitError(
                f"rank {self.comm.rank}: `engine.destroy()` while {held[:3]} are still held (a forward, "
                "backward or `GatheredParameters` block is running); destroy the engine outside them")
        self.gatherer.remove()
        if self.shards is not None:
            self.shards.closing = True  # the files are deleted below: no host copy is written back first
        for hook in self._grad_hooks.values():
            hook.remove()
        self._grad_hooks = {}
        while self.units:
            unit = self.units[0]
            if restore_params:
                unit.ensure_gathered()
            else:
                unit.settle()  # a prefetch in flight ends before its buffer goes
            with torch._C.DisableTorchFunctionSubclass():
                for index, param in enumerate(unit.params):
                    param.data = (unit.param_view(unit.full, index).clone() if restore_params
                                  else torch.empty(0, dtype=unit.full.dtype, device=unit.device))
                    restore_parameter(param)
            unit.unpersist()
            if unit.gathered:
                unit.free()
            unit.storage.discard()  # a shard kept in a file: its host copy goes now, unwritten, not with the file below
            # restored: a destroy retried after a failure here (a shard's read) goes on from the next unit, and
            # never reads this one's file again (its newest values were in the host copy just let go)
            self.units.pop(0)
        self._had = set()
        self.store.close()
        if self.shards is not None:
            self.shards.close()
            self.shards = None


def _on_grad(strategy: "weakref.ref[Stage3]", unit: "weakref.ref[Unit]", index: int, param: torch.Tensor) -> None:
    """A trainable parameter's post-accumulate hook, landing in this file first; both held weakly."""
    held, of = strategy(), unit()
    if held is not None and of is not None:
        held._on_grad(of, index, param)


def take_grads(unit: Unit, indices: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, set[int]]:
    """The gradients of ``unit``'s parameters ``indices`` in one full-size flat tensor of ``dtype`` (zeros where a
    parameter has none), laid out as the unit, and which had one; their ``param.grad`` is released."""
    # every element is written once below (a gradient, or zeros), so no memset of the whole unit first
    flat = torch.empty(unit.padded, dtype=dtype, device=unit.full.device)
    flat.narrow(0, unit.numel, unit.padded - unit.numel).zero_()
    wanted = set(indices)
    had_grad = set()
    with torch._C.DisableTorchFunctionSubclass():
        for index, (param, offset, shape) in enumerate(zip(unit.params, unit.offsets, unit.shapes)):
            view = flat.narrow(0, offset, shape.numel()).view(shape)
            if index not in wanted or param.grad is None:
                view.zero_()
                continue
            view.copy_(param.grad)
            param.grad = None
            had_grad.add(index)
    return flat, had_grad


def _check_module(module: nn.Module, comm: Comm) -> None:
    """Refuse parameters another stage 3 engine partitions, or ``zero.Init`` partitioned over another group."""
    for name, param in module.named_parameters():
        unit = unit_of(param)
        if unit is not None and isinstance(unit.owner, Gatherer):
            raise ValueError(
                f"rank {comm.rank}: parameter `{name}` is already partitioned by another stage 3 "
                "engine; call `engine.destroy()` on that engine before wrapping the module again")
        if unit is not None and unit.comm.world_size != comm.world_size:
            raise ValueError(
                f"rank {comm.rank}: parameter `{name}` was partitioned by `zero.Init` over "
                f"{unit.comm.world_size} ranks but the engine's process group has {comm.world_size}; "
                "pass the same `process_group` to `zero.Init` and `shardwise.initialize`")


def _initial_flat(unit: Unit, initial: dict[int, torch.Tensor]) -> torch.Tensor:
    """The unit's full fp32 values (``initial``: exact values by id; where the model was built under ``zero.Init``,
    its units' shards gathered, from the fp32 ``pristine`` where they were cast down)."""
    gathered: dict[int, torch.Tensor] = {}
    values = []
    for param in unit.params:
        source = unit_of(param)
        if source is None:
            values.append(initial.get(id(param), param.data))
            continue
        if id(source) not in gathered:
            shard = source.pristine if source.pristine is not None else source.shard
            full = torch.empty(source.padded, dtype=shard.dtype, device=shard.device)
            source.comm.all_gather(full, shard)
            gathered[id(source)] = full.float()
        values.append(source.param_view(gathered[id(source)], param.__dict__["_shardwise_index"]))
    device = values[0].device if values else torch.device("cpu")
    return unit.flatten(values, torch.float32, device)


def unit_specs(module: nn.Module, threshold: int) -> list[tuple[list[nn.Parameter], list[str], bool]]:
    """Which parameters of ``module`` form which unit, with their names and whether the unit is persistent:
    per module, its direct floating-point parameters not taken by an earlier module; modules holding at most
    ``threshold`` elements (``stage3_param_persistence_threshold``) merged into one persistent unit, last."""
    taken: set[int] = set()
    specs: list[tuple[list[nn.Parameter], list[str], bool]] = []
    small: tuple[list[nn.Parameter], list[str]] = ([], [])
    for prefix, child in module.named_modules():
        params, names = [], []
        for name, param in child._parameters.items():
            if param is None or id(param) in taken or not param.is_floating_point():
                continue
            taken.add(id(param))
            params.append(param)
            names.append(f"{prefix}.{name}" if prefix else name)
        if not params:
            continue
        if sum(p.numel() for p in params) <= threshold:
            small[0].extend(params)
            small[1].extend(names)
        else:
            specs.append((params, names, False))
    if small[0]:
        specs.append((small[0], small[1], True))
    return specs


# ============================================================ the store's side
class UnitSide:
    """This rank's pieces of stage 3's units (see the module docstring); ``in_files``: the shards live in a file."""

    def __init__(self, rank: int, in_files: bool) -> None:
        self.rank, self.in_files = rank, in_files
        #: the store whose masters follow the values written into the units (set once it is made)
        self.store: MasterStore
        self.by_unit: dict[Unit, list[Piece]] = {}
        #: elements of this rank's shard given out to pieces so far
        self.numel = 0
        #: the unit the last write went into, which the next may go on with
        self._waiting: list[Unit] = []
        #: per piece (by id), with the shards in memory: (its unit's shard tensor, the piece's view of it)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def pieces(self, unit: Unit, group_of: dict[int, int]) -> list[Piece]:
        """This rank's piece of each of ``unit``'s optimizer parameters (``group_of``: id -> param group), after
        ``unit.build``, placed in the shard after the pieces given out before."""
        pieces = []
        for index, start, end, offset in _cuts([s.numel() for s in unit.shapes], unit.shard_numel, self.rank):
            param = unit.params[index]
            if id(param) in group_of:
                pieces.append(Piece(param, unit.names[index], unit.shapes[index], start, end, self.numel,
                                    group_of[id(param)], index, offset, unit))
                self.numel += end - start
        if pieces:
            self.by_unit[unit] = pieces
        return pieces

    @staticmethod
    def initial(piece: Piece, values: torch.Tensor) -> torch.Tensor:
        """The piece's exact fp32 values at build: in its unit's shard when that is fp32 (``unit.build`` freed
        ``values`` then, it became the full buffer), else in ``values`` (the unit's full fp32 values); a wide shard
        (its masters) takes them over the compute dtype's rounding it was built with."""
        shard, unit = piece.unit.shard, piece.unit
        if shard.dtype == torch.float32 and not unit.wide:
            return _local(piece, shard)
        exact = values.narrow(0, unit.offsets[piece.index] + piece.start, piece.numel)
        return _local(piece, shard).copy_(exact) if unit.wide else exact

    def view(self, piece: Piece) -> Optional[torch.Tensor]:
        return None if self.in_files else _local(piece, piece.unit.shard)

    def values(self, piece: Piece) -> torch.Tensor:
        # a copy even in fp32: a view of a shard kept in a file would be its host copy, kept alive past its
        # eviction and no longer the shard
        values = _local(piece, piece.unit.shard).to(torch.float32, copy=True)
        piece.unit.shard_released()  # only read: a shard kept in a file may leave (`max_in_cpu`)
        return values

    def write(self, runs: Runs, last: bool = False) -> None:
        """Cast into the units' shards: in memory through fixed views, one ``foreach`` call; in files one write per
        unit, the units the write is past letting their shards go (all once the ``last`` write is done)."""
        if not self.in_files:
            if not runs:  # (a load with nothing of this rank's to write: foreach refuses empty lists)
                return
            torch._foreach_copy_([self._in_shard(piece).narrow(0, at, values.numel()) for piece, at, values in runs],
                                 [values for _, _, values in runs])
            return
        parts: dict[Unit, list[tuple[int, torch.Tensor]]] = {}  # per unit, in shard order
        for piece, at, values in runs:
            parts.setdefault(piece.unit, []).append((piece.offset + at, values))
        for unit, written in parts.items():
            unit.write_shard(written)
        self._release(list(parts))
        if last:
            self._release([])

    def _in_shard(self, piece: Piece) -> torch.Tensor:
        """The piece's elements of its unit's shard, kept in memory: a view made once per shard tensor."""
        shard = piece.unit.storage.shard
        cached = self._views.get(id(piece))
        if cached is None or cached[0] is not shard:
            cached = self._views[id(piece)] = (shard, _local(piece, shard))
        return cached[1]

    def settle(self) -> None:
        if self.in_files:  # (shards in memory hold no place between writes)
            self._release([])

    def _release(self, units: list[Unit]) -> None:
        """Units whose masters are all written may let their shards leave host memory (an offloaded shard); the
        last one may go on into the next sub-group, so it waits (read and written once a step, not twice)."""
        waiting = units[-1:]
        done = [unit for unit in dict.fromkeys([*self._waiting, *units]) if unit not in waiting]
        for unit in waiting:
            unit.pin_shard(True)  # before any release below lets the cache choose what leaves
        for unit in done:
            unit.pin_shard(False)
            unit.shard_released()
        self._waiting = waiting

    def on_params_modified(self, unit: Unit) -> None:
        """``GatheredParameters(modifier_rank=...)`` wrote ``unit``'s full values: as a write in a forward."""
        self.on_written(unit)

    def on_written(self, unit: Unit) -> None:
        """A forward wrote ``unit``'s gathered values in place: this rank's slice becomes its shard and masters
        (only pieces that changed: the others' fp32 masters keep their exact values, a copy would round them)."""
        with torch._C.DisableTorchFunctionSubclass():
            fresh = unit.local(unit.full)
            shard = unit.shard.to(fresh.dtype)  # (a wide shard as the compute dtype holds it)
            if torch.equal(fresh, shard):
                return
            changed = [p for p in self.by_unit.get(unit, ()) if not torch.equal(_local(p, fresh), _local(p, shard))]
            if unit.wide:
                self._overwrite(unit, fresh, changed)
                return
            for piece in changed:
                self.store.take(piece, _local(piece, fresh))
            unit.shard.copy_(fresh)

    def _overwrite(self, unit: Unit, values: torch.Tensor, taking: Sequence[Piece]) -> None:
        """A wide shard (the masters) takes ``values`` as the compute dtype holds them (what a shard of that dtype
        would hold), the pieces ``taking`` take them as they are, and every other piece's master stays."""
        shard = unit.shard
        kept = [(p, _local(p, shard).clone()) for p in self.by_unit.get(unit, ())
                if p not in taking and self.store.master_or_kept(p) is not None]
        shard.copy_(values.to(unit.full.dtype))
        for piece in taking:
            _local(piece, shard).copy_(_local(piece, values))
        for piece, master in kept:
            _local(piece, shard).copy_(master)

    def on_values_loaded(self, unit: Unit, values: torch.Tensor, loaded: set[int]) -> None:
        """``zero.load_state_dict`` gave ``unit`` fp32 ``values``: masters (kept ones too) take them exactly."""
        if unit.wide:  # (before `unit.load_shard`, which leaves a wide shard to this)
            self._overwrite(unit, values, [p for p in self.by_unit.get(unit, ()) if p.index in loaded])
            return
        for piece in self.by_unit.get(unit, ()):
            if piece.index in loaded:
                self.store.take(piece, _local(piece, values))

    def fill(self, unit: Unit, shard: torch.Tensor) -> None:
        """Write the masters (kept ones too) of ``unit``'s pieces into ``shard``, a full-precision copy of its shard."""
        for piece in self.by_unit.get(unit, ()):
            master = self.store.master_or_kept(piece)
            if master is not None:
                _local(piece, shard).copy_(master)


def _local(piece: Piece, shard: torch.Tensor) -> torch.Tensor:
    """The piece's elements of its unit's shard (or of a tensor laid out as it)."""
    return shard.narrow(0, piece.offset, piece.numel)


def piece_runs(units: Iterable[Sequence[torch.Tensor]], group_of: dict[int, int], rank: int, world: int) -> list[Run]:
    """The runs of the shard that :meth:`UnitSide.pieces` fills on ``rank`` for units holding the parameters
    ``units``, in order, before the units are built (as :class:`~.params.Unit` pads and cuts them)."""
    runs: list[Run] = []
    at = 0
    with torch._C.DisableTorchFunctionSubclass():
        for params in units:
            numels = [p.numel() for p in params]
            shard = max(1, -(-sum(numels) // world))
            for index, start, end, _ in _cuts(numels, shard, rank):
                if id(params[index]) in group_of:
                    runs.append(Run(len(runs), 0, end - start, at))
                    at += end - start
    return runs


def _cuts(numels: Sequence[int], shard: int, rank: int) -> Iterator[tuple[int, int, int, int]]:
    """For each parameter (of ``numels`` elements, laid one after the other) with elements in slice ``rank`` of
    ``shard`` elements: its index, ``[start, end)`` of its elements there, and where they start in the slice."""
    lo, offset = rank * shard, 0
    for index, numel in enumerate(numels):
        start, end = max(lo, offset), min(lo + shard, offset + numel)
        if start < end:
            yield index, start - offset, end - offset, start - lo
        offset += numel
