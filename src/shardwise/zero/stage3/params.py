"""Partitioned parameters: the storage model of ZeRO stage 3 and ``zero.Init`` (docs/stage3.md, "How parameters are
stored").

A :class:`Unit` is a group of parameters (normally one module's direct parameters) in one flat buffer of ``padded``
elements split into N equal slices: rank ``r`` keeps slice ``r`` (``unit.shard``) at all times. ``unit.full`` has
storage only while the unit is gathered; every parameter is a full-shape view into it.

Each partitioned parameter's class is swapped (as ``UninitializedParameter.materialize`` does) for a subclass whose
``__torch_function__`` notices an operation on values while the unit is freed and asks the unit's *owner*
(:class:`UnitOwner`: the stage 3 engine, ``zero.Init``) to gather it, or raises naming ``GatheredParameters``.  Metadata
is always readable.  The interception is per parameter object and undone by :func:`restore_parameter`: nothing
process-wide is patched.

Inside ``torch.compile``d code (docs/stage3.md, "torch.compile"): Dynamo cannot trace the eager bookkeeping, and must
not (a graph replays without Python).  So while Dynamo traces, an operation on a partitioned parameter goes straight to
torch, and the check runs once, at trace time (:func:`_check_read`, ``assume_constant_result``): the owner makes every
replay find the parameter gathered (stage 3 registers it as an external parameter of the running module) or raises.  The
stage 3 hooks never enter a graph (:func:`outside_graphs`): a graph breaks at each module call.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, TypeVar

import torch
from torch import nn

from ...comm.distributed import Comm, Work, wait_all

__all__ = [
    "outside_graphs", "skip_frames", "track", "traced_call", "untrack",
    "InMemoryShard", "ShardStorage", "Unit", "UnitError", "UnitOwner", "UnitState", "checksum", "gather_units",
    "hold", "is_partitioned", "let_go", "move", "not_gathered_error", "partition_parameter", "prepare_for_compile",
    "restore_parameter", "unit_of",
]

_UNIT_ATTR = "_shardwise_unit"
_INDEX_ATTR = "_shardwise_index"


class UnitOwner(Protocol):
    """Who decides what an operation on a freed parameter does (stage 3 or ``zero.Init``)."""

    def needs(self, unit: "Unit") -> bool:
        """Whether an operation reading ``unit``'s parameters must go through :meth:`on_demand`."""

    def on_demand(self, units: list["Unit"], func: Any, mutating: bool) -> contextlib.AbstractContextManager[None]:
        """Make ``units`` readable around ``func``, or raise."""

    def on_data_access(self, unit: "Unit") -> None:
        """``param.data`` was read while ``unit`` is freed: gather it, or raise (never hand out freed storage)."""

    def on_cast(self, unit: "Unit", device: Optional[torch.device], dtype: Optional[torch.dtype]) -> bool:
        """A ``.to()``/``.half()`` style cast of a freed parameter; True if it was applied to the unit."""

    def release(self, unit: "Unit") -> None:
        """Drop one hold on ``unit`` (taken with ``unit.acquire()``), freeing it when nothing holds it."""

    def on_params_modified(self, unit: "Unit") -> None:
        """New full values, the same on every rank, were written into ``unit``: its shard (and what copies it)
        follows, where they changed."""

    def on_values_loaded(self, unit: "Unit", values: torch.Tensor, loaded: set[int]) -> None:
        """``unit``'s shard takes the fp32 ``values`` (this rank's slice) for the parameters ``loaded`` (next)."""

    def on_traced_read(self, unit: "Unit", param: torch.Tensor) -> None:
        """``torch.compile`` traces a read of ``param``: make every replay of the graph find it gathered, or raise."""

    def on_gathered_data_access(self, unit: "Unit") -> None:
        """``param.data`` of the gathered ``unit`` was taken: whatever is done with it next cannot be seen."""

    def on_write(self, unit: "Unit") -> contextlib.AbstractContextManager[None]:
        """An in-place operation is about to write parameters of the gathered ``unit``: around the write."""


# ------------------------------------------------------------- life cycles
_S = TypeVar("_S", bound=enum.Enum)


class UnitError(RuntimeError):
    """A unit (or the model holding units) was used against its life cycle (a bug in shardwise or its caller)."""


def move(rank: int, what: str, current: _S, to: _S, allowed: Mapping[_S, frozenset[_S]], event: str, fix: str) -> _S:
    """The one checked move of stage 3's life cycles (a unit's :class:`UnitState`, a model's training state).  Returns
    ``to`` when the table ``allowed`` (per state, the states it may move to) lets ``current`` move there; otherwise
    raises a :class:`UnitError` naming ``what`` (a unit, a model), the state it was in, the move ``event`` attempted and
    ``fix``, instead of leaving the state wrong for a later step to trip over.
    """
    if to in allowed.get(current, frozenset()):
        return to
    sources = sorted(s.value for s, targets in allowed.items() if to in targets)
    expected = " or ".join(sources) if sources else "(no state: the move is never allowed)"
    raise UnitError(
        f"rank {rank}: {what} cannot {event} ({current.value} -> {to.value}): expected it {expected}, "
        f"found {current.value}; {fix}")


# ------------------------------------------------------------- the local shard
class ShardStorage(Protocol):
    """Where a unit's local shard lives: in memory (:class:`InMemoryShard`), or apart (:mod:`..offload.shards`)."""

    @property
    def device(self) -> torch.device:
        """The device the shard's values are used on."""

    def get(self) -> torch.Tensor:
        """The shard, in host memory (read from its file if it is not)."""

    def put(self, shard: torch.Tensor) -> None:
        """The shard becomes ``shard`` (a new tensor, e.g. cast)."""

    def write(self, parts: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Elements ``[at, at + len(values))`` of the shard take ``values`` (cast), for each ``(at, values)``."""

    def released(self) -> None:
        """No view of the shard is held any more: a point where shards kept in files may leave host memory."""

    def read_ahead(self) -> None:
        """The shard will be needed soon: start reading it if it is not in host memory."""

    def settle_read_ahead(self) -> None:
        """The pass that read the shard ahead ended without using it: the read stops holding a slot."""

    def held_bytes(self) -> int:
        """Bytes of the shard in host memory now."""

    def discard(self) -> None:
        """``engine.destroy()`` gave the unit's values to its parameters: a host copy of a shard kept in a file
        leaves now, unwritten (the file is deleted next); a shard kept in memory stays (optimizers view it)."""


class InMemoryShard:
    """The shard as a tensor of its own, always in memory (no offload)."""

    def __init__(self, shard: torch.Tensor) -> None:
        self.shard = shard

    @property
    def device(self) -> torch.device:
        return self.shard.device

    def get(self) -> torch.Tensor:
        return self.shard

    def put(self, shard: torch.Tensor) -> None:
        self.shard = shard

    def write(self, parts: Sequence[tuple[int, torch.Tensor]]) -> None:
        if parts:  # one foreach call: stage 3 publishes every piece of a unit after each step
            torch._foreach_copy_([self.shard.narrow(0, at, v.numel()) for at, v in parts], [v for _, v in parts],
                                 non_blocking=True)  # from pinned staging (host offload): not waited for

    def held_bytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()

    def released(self) -> None:
        """Nothing to do: the shard never leaves memory (nor is it read ahead, or let go unwritten)."""

    read_ahead = settle_read_ahead = discard = released


# ------------------------------------------------------------------ the unit
class UnitState(enum.Enum):
    """Where a unit's full values are."""

    #: only this rank's shard exists; the full buffer has no storage
    SHARDED = "sharded"
    #: an all-gather into the full buffer is in flight (a prefetch)
    GATHERING = "gathering"
    #: the full values are materialised and current
    GATHERED = "gathered"
    #: gathered once and never freed (small parameters)
    PERSISTENT = "persistent"


#: the moves of a unit's life cycle (see :class:`Unit`); anything else raises
_UNIT_MOVES: dict[UnitState, frozenset[UnitState]] = {
    UnitState.SHARDED: frozenset({UnitState.GATHERING}),
    UnitState.GATHERING: frozenset({UnitState.GATHERED}),
    UnitState.GATHERED: frozenset({UnitState.SHARDED, UnitState.PERSISTENT}),
    UnitState.PERSISTENT: frozenset({UnitState.GATHERED}),
}


class Unit:
    """Parameters stored as one flat buffer, ``1/N`` of it on each rank.

    Life cycle (:class:`UnitState`): ``SHARDED`` → ``gather(async_op=True)`` → ``GATHERING`` → ``wait()`` → ``GATHERED``
    → ``free()`` → ``SHARDED``; a persistent unit stays ``PERSISTENT`` (``free()`` leaves it gathered) until
    ``unpersist()``.  Every change goes through :meth:`_move`, which raises on a move the life cycle lacks: ``gather()``
    of a unit that is not sharded, ``wait()`` with no gather in flight.  Code that only needs the values present,
    whatever the state, says so with :meth:`ensure_gathered`.  ``holders`` counts who needs the full values right now
    (running forwards and backwards, ``GatheredParameters`` blocks); :meth:`acquire` and :meth:`release` are the only
    code that changes it, and freeing a held unit, or releasing one nobody holds, is an error rather than something to
    clamp.
    """

    def __init__(
        self,
        index: int,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        comm: Comm,
        owner: UnitOwner,
        persistent: bool = False,
    ) -> None:
        self.index = index
        self.params = list(params)
        self.names = list(names)
        self.comm, self.owner = comm, owner
        self.offsets: list[int] = []
        self.shapes: list[torch.Size] = []
        total = 0
        with torch._C.DisableTorchFunctionSubclass():
            for param in self.params:
                self.offsets.append(total)
                self.shapes.append(param.shape)
                total += param.numel()
        self.numel = total
        world = comm.world_size
        self.padded = -(-total // world) * world if total else world
        self.shard_numel = self.padded // world
        self.full: torch.Tensor = torch.empty(0)
        #: where this rank's slice lives (:attr:`shard` reads it)
        self.storage: ShardStorage = InMemoryShard(torch.empty(0))
        self.pristine: Optional[torch.Tensor] = None
        #: the shard is kept in fp32 (the masters' storage), the full values in the compute dtype (see `build`)
        self.wide = False
        #: where the full values are; changed only by :meth:`_move`
        self.state = UnitState.GATHERED  # until `build` keeps its shard and frees the rest
        #: whether the full values are (or are being) materialised: the state is not ``SHARDED`` (kept by
        #: :meth:`_move`; an attribute, not a property: the module hooks read it for every unit they pass)
        self.gathered = True
        #: how fault messages name this unit's collectives (same on every rank)
        first = f"`{self.names[0]}`" if self.names else f"unit {index}"
        self.label = first + (f" and {len(self.names) - 1} more" if len(self.names) > 1 else "")
        self._persistent, self._holders = persistent, 0
        self._work: Optional[Work] = None
        self._shard_pinned = False

    @property
    def shard(self) -> torch.Tensor:
        """This rank's slice of the unit, in the compute dtype or fp32 (:attr:`wide`; read from its file first where it
        lives in one)."""
        return self.storage.get()

    @shard.setter
    def shard(self, value: torch.Tensor) -> None:
        self.storage.put(value)

    @property
    def device(self) -> torch.device:
        """The device the unit's values live on (without reading an offloaded shard)."""
        return self.storage.device

    def read_ahead(self) -> None:
        """This unit will be gathered soon: a shard kept in a file starts coming into host memory."""
        if self.state is UnitState.SHARDED:
            self.storage.read_ahead()

    @property
    def shard_busy(self) -> bool:
        """Whether the shard must stay in host memory: an all-gather from it is in flight, or it is pinned."""
        return self.state is UnitState.GATHERING or self._shard_pinned

    def pin_shard(self, pinned: bool) -> None:
        """While pinned, a shard kept in a file stays in host memory (a step publishing into it over sub-groups)."""
        self._shard_pinned = pinned

    def write_shard(self, parts: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Each ``(at, values)`` into this rank's slice (cast); a shard kept in a file takes them there, unread."""
        self.storage.write(parts)

    def shard_released(self) -> None:
        """Nothing holds a view of the shard now: one kept in a file may leave host memory."""
        self.storage.released()

    @property
    def holders(self) -> int:
        return self._holders

    def acquire(self) -> None:
        """Take one hold: the full values must stay until the matching :meth:`release`."""
        self._holders += 1

    def release(self) -> int:
        """Drop one hold; returns how many remain (the owner frees the unit at zero)."""
        if self._holders == 0:
            raise UnitError(
                f"rank {self.comm.rank}: {self!r} was released once more than it was acquired "
                "(expected at least 1 holder, found 0); every `acquire()` needs exactly one `release()`")
        self._holders -= 1
        return self._holders

    @property
    def persistent(self) -> bool:
        return self._persistent

    def flatten(self, values: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A full-size flat tensor holding ``values`` (one per parameter) at their offsets, zero padded."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for offset, shape, value in zip(self.offsets, self.shapes, values):
            flat.narrow(0, offset, shape.numel()).copy_(value.reshape(-1))
        return flat

    def build(self, flat: torch.Tensor, dtype: torch.dtype, wide: bool = False) -> None:
        """Take the full flat values ``flat`` (same on every rank; the gathered buffer itself when of ``dtype``),
        keep this rank's slice, free the rest.  ``wide``: the slice is kept in ``flat``'s fp32, holding the values
        as ``dtype`` rounds them until the master weights take theirs, and cast to ``dtype`` when sent."""
        self.full, self.wide = flat.to(dtype), wide
        self.shard = self.local(self.full).to(flat.dtype if wide else dtype, copy=True)
        if self._persistent:
            self._move(UnitState.PERSISTENT, "stay gathered for good")
        for index, param in enumerate(self.params):
            partition_parameter(param, self, index)
        self.view_params()
        self.free()

    def unpersist(self) -> None:
        """A persistent unit becomes an ordinary gathered one (so it can be freed)."""
        self._persistent = False
        if self.state is UnitState.PERSISTENT:
            self._move(UnitState.GATHERED, "become freeable")

    def local(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full-size flat tensor of this unit."""
        return flat.narrow(0, self.comm.rank * self.shard_numel, self.shard_numel)

    def param_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s elements inside a full-size flat tensor, shaped like it."""
        shape = self.shapes[index]
        return flat.narrow(0, self.offsets[index], shape.numel()).view(shape)

    def view_params(self) -> None:
        """Point every parameter's ``.data`` at its place in ``self.full``."""
        with torch._C.DisableTorchFunctionSubclass():
            for index, param in enumerate(self.params):
                param.data = self.param_view(self.full, index)

    def _move(self, to: UnitState, event: str) -> None:
        """The one place the state changes: raises on a move the life cycle lacks."""
        if to not in _UNIT_MOVES[self.state]:  # (checked here: `move` builds the error)
            fix = "check `unit.state` (or call `ensure_gathered()`, which does what the state needs) first"
            move(self.comm.rank, repr(self), self.state, to, _UNIT_MOVES, event, fix)
        self.state = to
        self.gathered = to is not UnitState.SHARDED

    def gather(self, async_op: bool = False) -> None:
        """Start the all-gather of a sharded unit (collective); without ``async_op`` also finish it."""
        self._work = self.comm.all_gather(self.full, self._gathering(), async_op=True, label=self.label)
        if not async_op:
            self.wait()

    def _gathering(self) -> torch.Tensor:
        """A sharded unit is about to be all-gathered: its shard (what it sends), its full buffer's storage back."""
        # the shard first: a read from its file that fails leaves the unit sharded, not gathering with no all-gather
        shard = self._sent()
        self._move(UnitState.GATHERING, "start a gather")
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        return shard

    def _sent(self) -> torch.Tensor:
        """What this rank sends in an all-gather of the unit: its shard, in the compute dtype."""
        return self.shard.to(self.full.dtype) if self.wide else self.shard

    def wait(self) -> None:
        """Finish a gather started with ``async_op=True`` (``GATHERING`` → ``GATHERED``)."""
        work, self._work = self._work, None  # None unless a gather is in flight: then the move raises
        if work is None and self.state is UnitState.GATHERING:
            raise UnitError(
                f"rank {self.comm.rank}: {self!r} is gathering but no all-gather is in flight (expected one "
                "started by `gather()`, found none: it raised before or while it ran), so its full values "
                "were never filled; the engine cannot use this unit again: restart from the last checkpoint")
        if work is not None:
            work.wait()
        self._move(UnitState.GATHERED, "finish a gather")

    def settle(self) -> None:
        """Finish a gather in flight (a prefetch), if one is: afterwards no collective of this unit runs."""
        if self.state is UnitState.GATHERING:
            self.wait()

    def ensure_gathered(self) -> None:
        """The full values present whatever the state: gather a sharded unit, finish a gather in flight."""
        if self.state is UnitState.SHARDED:
            self.gather()
        self.settle()

    def free(self) -> None:
        """Drop the full values (a persistent unit stays gathered); freeing a sharded or held unit raises."""
        if self._holders:
            raise UnitError(
                f"rank {self.comm.rank}: {self!r} was freed while {self._holders} holder(s) still need its "
                "full values (expected 0 holders); release every hold before freeing")
        self.settle()  # a gather in flight (a prefetch) finishes first, even for a unit that stays
        if self.state is not UnitState.PERSISTENT:
            self._move(UnitState.SHARDED, "free its full values")
            self.full.untyped_storage().resize_(0)
        self.shard_released()  # freed after use: a shard kept in a file drops its host copy

    def scatter_from_full(self, src: Optional[int] = None) -> None:
        """After the full values changed: optionally take ``src``'s values (collective), update the shard, and the fp32
        ``pristine`` copy where its values changed (the others keep their exact values for the masters)."""
        if src is not None:
            self.take_full(src)  # (which checks the unit is gathered)
        else:
            self._expect_gathered("scatter its full values")
        fresh = self.local(self.full)
        if self.pristine is not None:
            changed = fresh != self.shard.to(fresh.dtype)
            self.pristine[changed] = fresh[changed].to(self.pristine.dtype)
        self.shard.copy_(fresh)

    def take_full(self, src: int) -> None:
        """The full values become rank ``src``'s (collective); the shard is the owner's to update."""
        self._expect_gathered("broadcast its full values")
        self.comm.broadcast(self.full, src=src, label=self.label)

    def load_shard(self, values: torch.Tensor) -> None:
        """This rank's slice becomes ``values`` (fp32, cast; a wide one took them from its owner); a gathered copy
        follows (collective when gathered)."""
        self.settle()
        if not self.wide:  # a wide shard holds the masters: the owner wrote them first (`on_values_loaded`)
            self.shard.copy_(values)
        if self.pristine is not None:
            self.pristine.copy_(values)  # the exact values masters will start from
        if self.gathered:
            self.refresh()

    def refresh(self) -> None:
        """Re-gather a gathered unit from the (updated) shards (collective); a sharded unit raises."""
        self._expect_gathered("refresh its full values")
        self.comm.all_gather(self.full, self._sent(), label=self.label)
        self.shard_released()  # only read (a persistent unit is never freed, where shards are released)

    def _expect_gathered(self, action: str) -> None:
        self.settle()
        if self.state is UnitState.SHARDED:
            raise UnitError(
                f"rank {self.comm.rank}: cannot {action} of {self!r}: expected it gathered, found "
                f"{self.state.value}; gather it first")

    def convert(self, device: Optional[torch.device], dtype: Optional[torch.dtype]) -> None:
        """Cast the shard (and the freed full buffer) to ``dtype``/``device``.  The first down-cast keeps the fp32 shard
        in ``pristine`` so master weights can start from exact values.
        """
        device = device or self.device
        dtype = dtype or self.shard.dtype
        if self.pristine is None and self.shard.dtype == torch.float32 and dtype != torch.float32:
            self.pristine = self.shard
        if self.pristine is not None and self.pristine.device != device:
            self.pristine = self.pristine.to(device)
        self.settle()
        gathered = self.gathered
        full = self.full.to(device=device, dtype=dtype) if gathered else torch.empty(
            self.padded, dtype=dtype, device=device)
        self.shard = self.shard.to(device=device, dtype=dtype)
        self.full = full
        self.view_params()  # views need the storage present: free it only afterwards
        if not gathered:
            self.full.untyped_storage().resize_(0)

    def element_bytes(self) -> int:
        return self.full.element_size()  # the shard's dtype, without reading an offloaded shard

    def __repr__(self) -> str:
        state = self.state.value
        names = self.names[:3] + (["..."] if len(self.names) > 3 else [])
        return f"Unit({self.index}, {names}, {self.numel} elements, {state})"


# ------------------------------------------------ the partitioned parameter
def unit_of(tensor: Any) -> Optional[Unit]:
    """The unit a partitioned parameter belongs to (None for any other tensor)."""
    return tensor.__dict__.get(_UNIT_ATTR) if isinstance(tensor, torch.Tensor) else None


def is_partitioned(tensor: Any) -> bool:
    """Whether ``tensor`` is a parameter partitioned by ZeRO stage 3 or ``zero.Init``."""
    return unit_of(tensor) is not None


def partition_parameter(param: nn.Parameter, unit: Unit, index: int) -> None:
    """Attach ``param`` to ``unit`` and swap its class so freed values are never read."""
    param.__dict__[_UNIT_ATTR] = unit
    param.__dict__[_INDEX_ATTR] = index
    track(param, unit)
    cls = type(param)
    if not getattr(cls, "_shardwise_partitioned", False):
        param.__class__ = _partitioned_class(cls)


def restore_parameter(param: nn.Parameter) -> None:
    """Undo :func:`partition_parameter` (the caller gives ``param`` its own full storage first)."""
    param.__dict__.pop(_UNIT_ATTR, None)
    param.__dict__.pop(_INDEX_ATTR, None)
    untrack(param)
    cls = type(param)
    if getattr(cls, "_shardwise_partitioned", False):
        param.__class__ = cls.__bases__[0]


def param_name(param: Any) -> str:
    unit = unit_of(param)
    if unit is None:
        return "<tensor>"
    return unit.names[param.__dict__[_INDEX_ATTR]]


def not_gathered_error(param: Any, func: Any) -> RuntimeError:
    """The error for reading a partitioned parameter where nothing gathers it."""
    unit = unit_of(param)
    rank = unit.comm.rank if unit is not None else 0
    name = param_name(param)
    with torch._C.DisableTorchFunctionSubclass():
        shape = tuple(param.shape)
    what = getattr(func, "__name__", repr(func))
    return RuntimeError(
        f"rank {rank}: parameter `{name}` (shape {shape}) is partitioned by ZeRO stage 3 and is not "
        f"gathered here (operation `{what}` outside any forward of its engine). Read or modify it inside "
        f"`with shardwise.zero.GatheredParameters([param], modifier_rank=None or 0): ...` on every rank, "
        "or call the module (hooks gather parameters during its forward)")


_CLASSES: dict[type, type] = {}


def _partitioned_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            f"Partitioned{cls.__name__}",
            (cls,),
            {
                "__torch_function__": classmethod(_torch_function),
                "_shardwise_partitioned": True,
                "__module__": __name__,
            },
        )
    return _CLASSES[cls]


def _descriptor_functions(names: Sequence[str]) -> set[Any]:
    found: set[Any] = set()
    for name in names:
        attr = getattr(torch.Tensor, name, None)
        for method in ("__get__", "__set__", "__delete__"):
            bound = getattr(attr, method, None)
            if bound is not None:
                found.add(bound)
    return found


# Operations that never read or write a parameter's values: allowed while freed.
_METADATA: set[Any] = _descriptor_functions(
    ["data", "shape", "dtype", "device", "layout", "requires_grad", "grad", "is_leaf", "grad_fn", "ndim",
     "is_cuda", "is_sparse", "is_quantized", "is_meta", "is_mkldnn", "is_nested", "output_nr",
     "_version", "_base", "names", "itemsize", "nbytes", "_grad", "_grad_fn", "retains_grad",
     "_backward_hooks", "_post_accumulate_grad_hooks"]
) | {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.ndimension, torch.Tensor.numel,
    torch.Tensor.nelement, torch.Tensor.element_size, torch.Tensor.is_floating_point,
    torch.Tensor.is_complex, torch.Tensor.requires_grad_, torch.Tensor.register_hook,
    torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.__len__, torch.Tensor.stride,
    torch.Tensor.is_contiguous, torch.Tensor.storage_offset, torch.Tensor.get_device,
    torch.Tensor.retain_grad, torch.Tensor.__hash__, torch.Tensor.data_ptr,
    torch.Tensor.untyped_storage, torch._has_compatible_shallow_copy_type,
}
_DATA_GET: Any = getattr(vars(torch._C.TensorBase)["data"], "__get__")  # noqa: B009 (typed Any)
_CASTS: dict[Any, Callable[..., tuple[Optional[torch.device], Optional[torch.dtype]]]] = {
    torch.Tensor.to: lambda *a, **k: torch._C._nn._parse_to(*a, **k)[:2],
    torch.Tensor.float: lambda *a, **k: (None, torch.float32),
    torch.Tensor.double: lambda *a, **k: (None, torch.float64),
    torch.Tensor.half: lambda *a, **k: (None, torch.float16),
    torch.Tensor.bfloat16: lambda *a, **k: (None, torch.bfloat16),
    torch.Tensor.cpu: lambda *a, **k: (torch.device("cpu"), None),
    torch.Tensor.cuda: lambda *a, **k: (torch.device("cuda", torch.cuda.current_device()), None),
}
#: cuDNN's RNN weight compaction, which ``nn.RNNBase.flatten_parameters`` runs from ``Module.to``/``_apply`` on CUDA:
#: it would re-point partitioned parameters into one full-size buffer.  It only speeds cuDNN up, and the unit's
#: gather rebuilds the weights for each forward anyway, so it is skipped while any of them is partitioned (its
#: result is unused: flatten_parameters discards it).  DeepSpeed's empty partitions dodge it by sharing a data pointer.
_RNN_FLATTEN: Any = getattr(torch, "_cudnn_rnn_flatten_weight", None)
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                    "__ifloordiv__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__imatmul__"}


def _is_mutating(func: Any, kwargs: dict[str, Any]) -> bool:
    name = getattr(func, "__name__", "")
    if name in _INPLACE_DUNDERS or kwargs.get("out") is not None:
        return True
    return name.endswith("_") and not name.endswith("__")


def _written_units(args: Sequence[Any], kwargs: dict[str, Any]) -> list[Unit]:
    """The units of the partitioned parameters an in-place operation writes (its ``out=`` or ``self``)."""
    out = kwargs.get("out")
    targets = out if out is not None else (args[0] if args else None)
    found: list[Unit] = []
    for value in targets if isinstance(targets, (list, tuple)) else (targets,):
        unit = unit_of(value)
        if unit is not None and unit not in found:
            found.append(unit)
    return found


def _partitioned_in(args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    found: list[Any] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            found.extend(v for v in value if _UNIT_ATTR in getattr(v, "__dict__", ()))
        elif _UNIT_ATTR in getattr(value, "__dict__", ()):
            found.append(value)
    return found


def _torch_function(cls: type, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
    kwargs = kwargs or {}
    if torch.compiler.is_compiling():  # Dynamo inlines this into a graph (below)
        return traced_call(func, args, kwargs)
    return _checked_call(func, args, kwargs)


def prepare_for_compile() -> None:
    """Let ``torch.compile`` trace operations on partitioned parameters (see the section below); idempotent."""
    skip_frames(_torch_function)


def _checked_call(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The eager ``__torch_function__`` of a partitioned parameter (see the module docstring)."""
    if func in _METADATA:
        if func == _DATA_GET:  # method-wrappers are created per access: compare, not `is`
            unit = unit_of(args[0])
            if unit is not None and not unit.gathered:
                unit.owner.on_data_access(unit)
            if unit is not None:
                unit.owner.on_gathered_data_access(unit)  # `param.data.mul_(...)` writes through a plain tensor
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    units: list[Unit] = []
    for param in _partitioned_in(args, kwargs):
        unit = param.__dict__[_UNIT_ATTR]
        if unit not in units and unit.owner.needs(unit):
            units.append(unit)
    if units and func is _RNN_FLATTEN:
        return None  # see _RNN_FLATTEN
    written = _written_units(args, kwargs) if _is_mutating(func, kwargs) else []
    if not units and not written:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if func in _CASTS and len(units) == 1 and args and unit_of(args[0]) is units[0] and not units[0].gathered:
        device, dtype = _CASTS[func](*args[1:], **kwargs)
        if units[0].owner.on_cast(units[0], device, dtype):
            with torch._C.DisableTorchFunctionSubclass():
                return args[0].data  # the converted (still freed) view, for Module._apply
    owners = {id(u.owner): u.owner for u in units}
    with contextlib.ExitStack() as stack:
        for owner in owners.values():
            stack.enter_context(owner.on_demand([u for u in units if u.owner is owner], func,
                                                _is_mutating(func, kwargs)))
        for unit in written:  # entered after the gathers: exits (writes back) before they are released
            stack.enter_context(unit.owner.on_write(unit))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def checksum(flat: torch.Tensor) -> int:
    """A number that changes when bits of ``flat`` change or move (same on every rank for the same values).  A
    position-weighted sum of the bit patterns (wrapping in int64): exact, unlike a float sum, and cheap enough for the
    rare write it looks at.
    """
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[flat.element_size()]
    with torch._C.DisableTorchFunctionSubclass():
        values = flat.reshape(-1).view(bits).to(torch.int64)
        weights = torch.arange(values.numel(), dtype=torch.int64, device=values.device) % 1021 + 1
        return int(torch.sum(values * weights))


def gather_units(units: Sequence[Unit]) -> None:
    """Gather several units (those not gathered yet), overlapping their collectives."""
    hold((), units)
    for unit in units:
        unit.ensure_gathered()


def hold(units: Sequence[Unit], ahead: Sequence[Unit] = ()) -> None:
    """Take a hold on each of ``units`` (:meth:`Unit.acquire`) with its full values present, and start gathering
    the sharded ones of ``ahead`` (a prefetch) with them: the gathers of both in one call, ``units``'s first, then
    ``units``'s waited for.  Module hooks call it once per module call, not once per unit."""
    starting = [unit for unit in dict.fromkeys([*units, *ahead]) if unit.state is UnitState.SHARDED]
    if starting:
        try:
            for unit in starting:
                # every shard read before any unit moves: one that fails to read from its file leaves them all
                # sharded, none gathering with no all-gather issued (a shard read stays in host memory for the gather)
                unit.shard  # noqa: B018
        except BaseException:
            for unit in starting:
                unit.shard_released()  # the shards read before the failure may leave host memory, as after a gather
            raise
        pairs = [(unit.full, unit._gathering()) for unit in starting]
        works = starting[0].comm.all_gather_each(pairs, [unit.label for unit in starting])
        for unit, work in zip(starting, works):
            unit._work = work
    for unit in units:
        unit._holders += 1
    waiting = [unit for unit in units if unit.state is UnitState.GATHERING]
    if waiting:
        for unit in waiting:
            if unit._work is None:
                unit.wait()  # raises: gathering with no all-gather in flight
        wait_all([unit._work for unit in waiting if unit._work is not None])
        for unit in waiting:
            unit._work = None
            unit._move(UnitState.GATHERED, "finish a gather")


def let_go(units: Sequence[Unit]) -> list[Unit]:
    """Drop one hold on each of ``units`` (:meth:`Unit.release`) and free each that nothing holds any more; the
    units freed (one call per module call, not one per unit)."""
    freed = []
    for unit in units:
        if unit.release() == 0:
            unit.free()
            freed.append(unit)
    return freed


# ------------------------------------------------ inside torch.compile (see the module docstring)
_F = TypeVar("_F", bound=Callable[..., Any])

#: id(parameter) -> (the parameter, its unit): how a check at trace time finds both from a constant.  Both
#: held weakly (a unit holds its engine's machinery: a dropped engine and model must be freed), and an entry
#: goes with its parameter.
_TRACKED: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[Any]]] = {}


def track(param: torch.Tensor, unit: Any) -> None:
    """``param`` is partitioned into ``unit``: a traced read of it is checked by ``unit.owner``."""
    key = id(param)

    def gone(ref: weakref.ref[torch.Tensor]) -> None:
        if _TRACKED.get(key, (None,))[0] is ref:  # not a later parameter that got the same id
            del _TRACKED[key]

    _TRACKED[key] = (weakref.ref(param, gone), weakref.ref(unit))


def untrack(param: torch.Tensor) -> None:
    """``param`` is no longer partitioned."""
    _TRACKED.pop(id(param), None)


def traced_call(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """What a partitioned parameter's ``__torch_function__`` does while Dynamo traces it.  Every operation counts as a
    read, metadata too: Dynamo cannot hash ``func`` to tell them apart, and the check costs nothing once traced.
    """
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if getattr(type(item), "_shardwise_partitioned", False):
                _check_read(id(item))
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def outside_graphs(fn: _F) -> _F:
    """``fn`` always runs eagerly: a graph being traced breaks where it is called (``torch._dynamo.disable``)."""
    import torch._dynamo  # here, not at import: it costs ~0.9 s, paid by stage 3 engines only

    return torch._dynamo.disable(fn)  # type: ignore[no-any-return]


def skip_frames(fn: Callable[..., Any]) -> None:
    """Dynamo never compiles ``fn`` (nor what it calls) as a frame of its own; it still inlines ``fn``
    while tracing code that calls it.  An operation run eagerly between two graphs then takes its
    eager path, checks included, instead of being traced alone with the checks left out."""
    import torch._dynamo  # here, not at import, as in `outside_graphs`
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    torch._dynamo.eval_frame.set_code_exec_strategy(fn.__code__, strategy)


def _check_read_now(param_id: int) -> bool:
    entry = _TRACKED.get(param_id)
    param, unit = (entry[0](), entry[1]()) if entry is not None else (None, None)
    if param is None or unit is None:
        return True
    unit.owner.on_traced_read(unit, param)
    return True


def _check_read(param_id: int) -> bool:
    """While Dynamo traces, a call of this runs :func:`_check_read_now` in Python and leaves a constant."""
    return _check_read_now(param_id)


# What `torch._dynamo.assume_constant_result` does (it only sets this), without importing Dynamo here.
_check_read._dynamo_marked_constant = True  # type: ignore[attr-defined]
