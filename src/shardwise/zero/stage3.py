"""Stage 3: parameters, gradients, master weights and optimizer state all sharded.

Layout.  Every module's *direct* floating-point parameters form one
:class:`~.params.Unit` (a flat buffer padded to a multiple of N; rank ``r``
keeps slice ``r`` in the compute dtype).  Units of at most
``stage3_param_persistence_threshold`` elements are merged into one
*persistent* unit that stays gathered.  A tied parameter belongs to the first
module that holds it; every module holding it gathers that unit.

Master weights.  For each trainable parameter this rank owns a *piece*: the
elements ``[start, end)`` of the flattened parameter that fall into its slice
of the unit, as a standalone fp32 tensor (in fp32 runs, a view into the
unit's slice itself: the slice *is* the master weight, as in torch FSDP).  The inner optimizer's param groups
hold these pieces in place of the model's parameters (same groups,
hyperparameters untouched), so any torch optimizer, or a wrapper exposing
``param_groups``, steps exactly this rank's 1/N.  A piece's ``.grad`` is None
while its parameter is frozen (or got no gradient this step anywhere), so the
optimizer skips it exactly as torch skips a parameter whose ``.grad`` is None.

Gradients.  Autograd writes full-size gradients into ``param.grad``; between
accumulation boundaries they just accumulate there.  At a boundary
(``sync``), once every trainable parameter of a unit has its gradient, the
unit's gradients are copied into one fp32 flat tensor and reduce-scattered
(asynchronously, a couple in flight); the result, divided by N, is added to
the pieces' gradients (allocated by the first reduction after ``zero_grad``,
dropped by it) and ``param.grad`` is released.  Units are reduced in
a fixed order (reverse order of first use in forward, then the rest), so all
ranks issue the same collectives in the same order.

Step.  ``after_step`` copies the updated pieces into the local slice of each
unit (nothing to copy in fp32): no communication, the next forward gathers
the new values.  Only the persistent unit is re-gathered.

The hooks that gather and free units live in :mod:`.hooks`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..param_state import OptimizerSlot, ParamShard
from .base import Apply, Strategy, module_order, tensor_bytes
from .frozen import FrozenStore, Kept
from .gathered import GatheredParameters
from .hooks import Gatherer
from .params import Unit, UnitError, is_partitioned, restore_parameter, unit_of

__all__ = ["Stage3"]

_MAX_IN_FLIGHT = 2


@dataclass(eq=False)
class _Piece:
    """The elements ``[start, end)`` of parameter ``param`` of ``unit`` that this rank owns."""

    unit: Unit
    index: int
    start: int
    end: int
    offset: int  # where they sit in ``unit.shard``
    group: int
    master: Optional[torch.Tensor] = None
    grad: Optional[torch.Tensor] = None

    @property
    def numel(self) -> int:
        return self.end - self.start

    def local(self, shard: torch.Tensor) -> torch.Tensor:
        return shard.narrow(0, self.offset, self.numel)

    @property
    def param(self) -> nn.Parameter:
        return self.unit.params[self.index]


class Stage3(Strategy):
    """Partitioned parameters gathered by module hooks; see the module docstring."""

    stage = 3
    shards_grads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.units: list[Unit] = []
        self.gatherer = Gatherer(self.module, self.units, {}, self.zero_config)
        self.gatherer.modified_callback = self._on_params_modified
        self.gatherer.loaded_callback = self._on_values_loaded
        self.gatherer.written_callback = self._on_written
        #: masters and optimizer state of frozen pieces, kept until they train again
        self.frozen = FrozenStore()
        self._pieces: list[_Piece] = []
        self._pieces_of: dict[int, list[_Piece]] = {}
        self._by_unit: dict[Unit, list[_Piece]] = {}
        self._groups: list[list[nn.Parameter]] = []
        self._params: list[nn.Parameter] = []  # the optimizer's parameters, module order
        self._group_of: dict[int, int] = {}
        self._mask: tuple[bool, ...] = ()
        self._trainable: dict[Unit, list[int]] = {}  # unit -> indices of its trainable params
        self._grad_hooks: dict[int, Any] = {}
        self._order: list[Unit] = []
        self._next = 0
        self._ready: set[Unit] = set()
        self._arrived: dict[Unit, set[int]] = {}
        self._works: list[tuple[Any, Unit, torch.Tensor, torch.Tensor, set[int]]] = []
        self._dirty = False
        #: fp32 compute: the unit slices are the master weights (no separate fp32 copy)
        self.alias = self.precision.dtype == torch.float32

    # ================================================================ build
    def attach(self, inner: Optional[Any], initial: Optional[dict[int, torch.Tensor]] = None) -> None:
        super().attach(inner, initial)
        self._check_module()
        if inner is not None:
            self._groups = [list(group["params"]) for group in inner.param_groups]
            self._params = module_order(self.module, self._groups)
            self._group_of = {id(p): g for g, params in enumerate(self._groups) for p in params}
        self._mask = tuple(p.requires_grad for p in self._params)
        self._build_units()
        self.initial = {}
        self._refresh_pieces()
        self._point_optimizer()
        self._register_grad_hooks()
        self.gatherer.install()

    def _check_module(self) -> None:
        for name, param in self.module.named_parameters():
            unit = unit_of(param)
            if unit is not None and isinstance(unit.owner, Gatherer):
                raise ValueError(
                    f"rank {self.comm.rank}: parameter `{name}` is already partitioned by another stage 3 "
                    "engine; call `engine.destroy()` on that engine before wrapping the module again"
                )
            if unit is not None and unit.comm.world_size != self.comm.world_size:
                raise ValueError(
                    f"rank {self.comm.rank}: parameter `{name}` was partitioned by `zero.Init` over "
                    f"{unit.comm.world_size} ranks but the engine's process group has {self.comm.world_size}; "
                    "pass the same `process_group` to `zero.Init` and `shardwise.initialize`"
                )

    def _unit_specs(self) -> list[tuple[list[nn.Parameter], list[str], bool]]:
        return unit_specs(self.module, int(self.zero_config.stage3_param_persistence_threshold))

    def _build_units(self) -> None:
        dtype = self.precision.dtype
        for params, names, persistent in self._unit_specs():
            unit = Unit(len(self.units), params, names, self.comm, self.gatherer, persistent)
            values = self._initial_flat(unit)
            pieces = self._make_pieces(unit, values)
            unit.build(values, dtype)
            if self.alias:
                for piece in pieces:
                    if unit.params[piece.index].requires_grad:
                        piece.master = piece.local(unit.shard)
            self.units.append(unit)
        holders: dict[nn.Module, list[Unit]] = {}
        for module in self.module.modules():
            found: list[Unit] = []
            for param in module._parameters.values():
                holder = unit_of(param)
                if holder is not None and not holder.persistent and holder not in found:
                    found.append(holder)
            if found:
                holders[module] = found
        self.gatherer.module_units = holders

    def _initial_flat(self, unit: Unit) -> torch.Tensor:
        """The unit's full fp32 values (from ``zero.Init`` shards where the model was built partitioned)."""
        gathered: dict[int, torch.Tensor] = {}
        values = []
        for param in unit.params:
            source = unit_of(param)
            if source is None:
                values.append(self.initial.get(id(param), param.data))
                continue
            if id(source) not in gathered:
                gathered[id(source)] = _gather_fp32(source)
            values.append(source.param_view(gathered[id(source)], param.__dict__["_shardwise_index"]))
        device = values[0].device if values else torch.device("cpu")
        return unit.flatten(values, torch.float32, device)

    def _make_pieces(self, unit: Unit, values: torch.Tensor) -> list[_Piece]:
        """This rank's piece of each of the unit's optimizer parameters (master made when trainable)."""
        made = []
        lo = self.comm.rank * unit.shard_numel
        hi = lo + unit.shard_numel
        for index, param in enumerate(unit.params):
            if id(param) not in self._group_of:
                continue
            offset = unit.offsets[index]
            start, end = max(lo, offset), min(hi, offset + unit.shapes[index].numel())
            if start >= end:
                continue
            piece = _Piece(unit, index, start - offset, end - offset, start - lo, self._group_of[id(param)])
            if param.requires_grad and not self.alias:
                piece.master = values.narrow(0, start, end - start).clone()
            self._pieces.append(piece)
            self._pieces_of.setdefault(id(param), []).append(piece)
            made.append(piece)
        return made

    def _point_optimizer(self) -> None:
        """Put this rank's fp32 pieces into the inner optimizer's groups in place of the parameters."""
        if self.inner is None:
            return
        for group, originals in zip(self.inner.param_groups, self._groups):
            group["params"] = [
                piece.master for p in originals for piece in self._pieces_of.get(id(p), ()) if piece.master is not None
            ]

    def _register_grad_hooks(self) -> None:
        """Hook every trainable parameter once (torch refuses hooks on frozen ones: added when unfrozen)."""
        for param in self._params:
            if is_partitioned(param) and param.requires_grad and id(param) not in self._grad_hooks:
                self._grad_hooks[id(param)] = param.register_post_accumulate_grad_hook(self._on_grad)

    # ======================================================== trainability
    def trainable_changed(self) -> bool:
        return tuple(p.requires_grad for p in self._params) != self._mask

    def refresh_trainable(self) -> None:
        self._mask = tuple(p.requires_grad for p in self._params)
        if self._refresh_pieces():
            self._point_optimizer()
        self._register_grad_hooks()

    def _refresh_pieces(self) -> bool:
        """Newly trainable pieces get their master (kept one, or from the shard); newly frozen ones
        leave the optimizer, their master and state kept in the frozen store.  True if anything moved."""
        moved = False
        state = self.inner.state if self.inner is not None else {}
        for piece in self._pieces:
            param = piece.param
            if param.requires_grad and piece.master is None:
                self._unfreeze(piece, state)
                moved = True
            elif not param.requires_grad and piece.master is not None:
                slot = OptimizerSlot(state, piece.master)
                kept = Kept(piece.start, piece.end, piece.master)
                kept.slot.set(slot.get())
                state.pop(piece.master, None)
                self.frozen.keep(param, kept)
                piece.master.grad = None
                piece.master, piece.grad = None, None
                moved = True
        self._trainable = {}
        for param in self._params:
            unit = unit_of(param)
            if unit is not None and param.requires_grad:
                self._trainable.setdefault(unit, []).append(param.__dict__["_shardwise_index"])
        return moved

    def _unfreeze(self, piece: _Piece, state: Any) -> None:
        kept = self.frozen.take(piece.param)
        if kept is not None:
            piece.master = kept.master
            if kept.state:
                OptimizerSlot(state, kept.master).set(kept.state)
            return
        local = piece.local(piece.unit.shard)
        # Frozen at start: its fp32 value was never kept, the compute dtype is the best there is.
        piece.master = local if self.alias else local.float()

    def has_pending_grads(self) -> bool:
        return self._dirty

    def trained_count(self) -> int:
        return sum(len(indices) for indices in self._trainable.values())

    # ============================================================ backward
    def start_backward(self, sync: bool) -> None:
        super().start_backward(sync)
        self._dirty = True
        self._arrived = {}
        self._ready = set()
        self._next = 0
        if sync:
            self._order = self._reduce_order()

    def _reduce_order(self) -> list[Unit]:
        """Reverse order of first use in forward, then the units that forward did not use."""
        used = [u for u in reversed(list(self.gatherer.forward_order)) if u in self._trainable]
        rest = [u for u in self.units if u in self._trainable and u not in set(used)]
        return used + rest

    def _on_grad(self, param: torch.Tensor) -> None:
        unit = unit_of(param)
        if unit is None or unit not in self._trainable or not self.in_backward:
            return  # (not in this engine's backward: another engine's loss reached this model)
        self.arrivals += 1
        arrived = self._arrived.setdefault(unit, set())
        arrived.add(param.__dict__["_shardwise_index"])
        if len(arrived) < len(self._trainable[unit]):
            return
        self.gatherer.grads_ready(unit)
        if self.sync and unit not in self._ready:
            self._ready.add(unit)
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self._order) and self._order[self._next] in self._ready:
            self._launch(self._order[self._next])
            self._next += 1

    def _launch(self, unit: Unit) -> None:
        # fp32 unless `communication_data_type` halves the bytes on the wire; averaged into fp32 below
        wire = self.precision.reduce_dtype
        source = torch.zeros(unit.padded, dtype=wire, device=unit.shard.device)
        had_grad = set()
        with torch._C.DisableTorchFunctionSubclass():
            for index in self._trainable[unit]:
                param = unit.params[index]
                if param.grad is not None:
                    unit.param_view(source, index).copy_(param.grad)
                    param.grad = None
                    had_grad.add(index)
        output = torch.empty(unit.shard_numel, dtype=wire, device=source.device)
        work = self.comm.reduce_scatter(output, source, async_op=True, label=unit.label)
        self._works.append((work, unit, source, output, had_grad))
        while len(self._works) > _MAX_IN_FLIGHT:
            self._complete(self._works.pop(0))

    def _complete(self, entry: tuple[Any, ...]) -> None:
        work, unit, _, output, had_grad = entry
        work.wait()
        scale = 1.0 / self.comm.world_size
        trainable = self._trainable[unit]
        for piece in self._pieces_by_unit().get(unit, ()):
            if piece.master is None or piece.index not in trainable:
                continue
            reduced = piece.local(output)
            if piece.index not in had_grad and not bool(reduced.any()):
                continue  # no rank produced a gradient: stays None, skipped like torch skips grad=None
            if piece.grad is None:
                piece.grad = reduced.float().mul(scale)
            else:
                piece.grad.add_(reduced, alpha=scale)
            piece.master.grad = piece.grad

    def _pieces_by_unit(self) -> dict[Unit, list[_Piece]]:
        if not self._by_unit:
            for piece in self._pieces:
                self._by_unit.setdefault(piece.unit, []).append(piece)
        return self._by_unit

    def finish_backward(self) -> None:
        super().finish_backward()
        self.gatherer.forward_order = {}
        if not self.sync:
            return
        for unit in self._order[self._next :]:
            self._launch(unit)
        self._next = len(self._order)
        for entry in self._works:
            self._complete(entry)
        self._works = []

    # ================================================================ step
    def _grads(self) -> list[torch.Tensor]:
        return [p.master.grad for p in self._pieces if p.master is not None and p.master.grad is not None]

    def grad_sq(self) -> torch.Tensor:
        grads = self._grads()
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        norms = torch._foreach_norm(grads)
        return torch.stack(norms).square().sum()

    def scale_grads(self, factor: float) -> None:
        grads = self._grads()
        if factor != 1.0 and grads:
            torch._foreach_mul_(grads, factor)

    def after_step(self) -> None:
        masters = [(p.local(p.unit.shard), p.master) for p in self._pieces if p.master is not None]
        if masters and not self.alias:
            torch._foreach_copy_([local for local, _ in masters], [master for _, master in masters])
        for unit in self.units:
            if unit not in self._trainable or not unit.gathered:
                continue
            if unit.holders == 0 and not unit.persistent:
                self.gatherer.drop(unit)  # stale full values: drop them, the next use re-gathers
            else:
                unit.refresh()

    def zero_grad(self) -> None:
        self._dirty = False
        self._arrived = {}
        self._ready = set()
        for piece in self._pieces:
            piece.grad = None  # the next reduction allocates it again
            if piece.master is not None:
                piece.master.grad = None
        with torch._C.DisableTorchFunctionSubclass():
            for unit in self.units:
                for param in unit.params:
                    param.grad = None

    def _on_params_modified(self, unit: Unit) -> None:
        """``GatheredParameters(modifier_rank=...)`` changed ``unit``: master weights (kept ones too) follow."""
        if self.alias:
            return  # the masters are views of the shard that was just updated
        for piece in self._pieces_by_unit().get(unit, ()):
            master = piece.master
            if master is None and (kept := self.frozen.get(piece.param)) is not None:
                master = kept.master
            if master is not None:
                master.copy_(piece.local(unit.shard))

    def _on_written(self, unit: Unit) -> None:
        """A forward wrote ``unit``'s gathered values in place: this rank's slice becomes its shard and masters.

        Only the parameters whose slice changed are copied, so the fp32 masters of the others keep
        their exact values (a copy from the compute dtype would round them).
        """
        with torch._C.DisableTorchFunctionSubclass():
            fresh = unit.local(unit.full)
            if torch.equal(fresh, unit.shard):
                return
            for index in range(len(unit.params)):
                start, end = self._slice_of(unit, index)
                if start < end and not torch.equal(fresh[start:end], unit.shard[start:end]):
                    self._write_piece(unit, index, fresh[start:end])
            unit.shard.copy_(fresh)

    def _slice_of(self, unit: Unit, index: int) -> tuple[int, int]:
        """Where parameter ``index`` of ``unit`` lies in this rank's shard (empty when it lies elsewhere)."""
        lo = self.comm.rank * unit.shard_numel
        offset = unit.offsets[index]
        start = max(lo, offset)
        end = min(lo + unit.shard_numel, offset + unit.shapes[index].numel())
        return start - lo, max(start, end) - lo

    def _write_piece(self, unit: Unit, index: int, values: torch.Tensor) -> None:
        for piece in self._pieces_by_unit().get(unit, ()):
            if piece.index != index:
                continue
            master = piece.master
            if master is None and (kept := self.frozen.get(piece.param)) is not None:
                master = kept.master
            if master is not None and master.data_ptr() != piece.local(unit.shard).data_ptr():
                master.copy_(values)

    def _on_values_loaded(self, unit: Unit, values: torch.Tensor, loaded: set[int]) -> None:
        """``zero.load_state_dict`` gave ``unit`` fp32 values: masters (kept ones too) take them exactly."""
        for piece in self._pieces_by_unit().get(unit, ()):
            master = piece.master
            if master is None and (kept := self.frozen.get(piece.param)) is not None:
                master = kept.master
            if master is not None and piece.index in loaded and master.data_ptr() != piece.local(unit.shard).data_ptr():
                master.copy_(piece.local(values))

    # ========================================================== accounting
    def memory_breakdown(self) -> dict[str, int]:
        params = sum(u.shard.numel() * u.shard.element_size() for u in self.units)
        params += sum(u.padded * u.element_bytes() for u in self.units if u.persistent)
        params += tensor_bytes([p for p in self.module.parameters() if not is_partitioned(p)])
        grads = [p.grad for p in self._pieces if p.grad is not None]
        with torch._C.DisableTorchFunctionSubclass():
            grads += [p.grad for u in self.units for p in u.params if p.grad is not None]
        state = getattr(self.inner, "state", {}) if self.inner is not None else {}
        masters = 0
        if not self.alias:  # in fp32 the masters are the shards themselves
            masters = tensor_bytes([p.master for p in self._pieces if p.master is not None])
            masters += self.frozen.master_bytes()
        return {
            "parameters": params,
            "master_weights": masters,
            "gradients": tensor_bytes(grads),
            "optimizer_state": tensor_bytes(list(state.values())) + self.frozen.state_bytes(),
        }

    def full_master_weights(self) -> dict[int, torch.Tensor]:
        result: dict[int, torch.Tensor] = {}
        by_unit = self._pieces_by_unit()
        for unit in self.units:
            shard = unit.shard.float()
            for piece in by_unit.get(unit, ()):
                master = piece.master
                if master is None and (kept := self.frozen.get(piece.param)) is not None:
                    master = kept.master
                if master is not None:
                    piece.local(shard).copy_(master)
            full = torch.empty(unit.padded, dtype=torch.float32, device=shard.device)
            self.comm.all_gather(full, shard)
            for index, param in enumerate(unit.params):
                result[id(param)] = unit.param_view(full, index).clone()
        return result

    # ========================================================== checkpoint
    @contextlib.contextmanager
    def checkpoint_shards(self, loading: bool, wanted: frozenset[str] = frozenset()) -> Iterator[list[ParamShard]]:
        if self.inner is None:
            yield []
            return
        names = {id(p.param): p.unit.names[p.index] for p in self._pieces}
        groups = {id(p.param): p.group for p in self._pieces}
        frozen = [p.param for p in self._pieces if p.master is None]
        if not loading:
            yield self._shards() + self.frozen.shards(frozen, names, groups)
            return
        by_param = {id(p.param): p for p in self._pieces}
        with self.frozen.loading(frozen, lambda p: names[id(p)] in wanted,
                                 lambda p: self._fresh_kept(by_param[id(p)]),
                                 lambda p, kept: self._write_kept(by_param[id(p)], kept)):
            yield self._shards() + self.frozen.shards(frozen, names, groups)
        for unit in self.units:  # frozen units took loaded values: drop stale gathered copies
            if unit.gathered and unit not in self._trainable:
                unit.refresh()

    def _shards(self) -> list[ParamShard]:
        shards = []
        for piece in self._pieces:
            if piece.master is None:
                continue
            unit = piece.unit
            slot = OptimizerSlot(self.inner.state, piece.master)
            shards.append(ParamShard(unit.names[piece.index], unit.shapes[piece.index], piece.start, piece.end,
                                     piece.master, piece.group, slot))
        return shards

    def _fresh_kept(self, piece: _Piece) -> Kept:
        local = piece.local(piece.unit.shard)
        return Kept(piece.start, piece.end, local if self.alias else local.float())

    def _write_kept(self, piece: _Piece, kept: Kept) -> None:
        local = piece.local(piece.unit.shard)
        if local.data_ptr() != kept.master.data_ptr():
            local.copy_(kept.master)

    def save_entries(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Partitioned entries are gathered one at a time; entry ``i`` of them is written by rank
        ``i % N``, so no rank holds more than its share (collective)."""
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

    # =============================================================== close
    def close(self) -> None:
        """Remove every hook and give each parameter back its full storage (collective)."""
        held = [unit for unit in self.units if unit.holders]
        if held:
            raise UnitError(
                f"rank {self.comm.rank}: `engine.destroy()` while {held[:3]} are still held (a forward, "
                "backward or `GatheredParameters` block is running); destroy the engine outside them"
            )
        self.gatherer.remove()
        for hook in self._grad_hooks.values():
            hook.remove()
        self._grad_hooks = {}
        for unit in self.units:
            unit.gather()
            with torch._C.DisableTorchFunctionSubclass():
                for index, param in enumerate(unit.params):
                    param.data = unit.param_view(unit.full, index).clone()
                    restore_parameter(param)
            unit.unpersist()
            unit.free()
        self.units = []


def _gather_fp32(unit: Unit) -> torch.Tensor:
    """The full flat fp32 values of a ``zero.Init`` unit (exact when it was cast down)."""
    source = unit.pristine if unit.pristine is not None else unit.shard
    gathered = torch.empty(unit.padded, dtype=source.dtype, device=source.device)
    unit.comm.all_gather(gathered, source)
    return gathered.float()


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
