"""Stage 3's pieces and their fp32 master weights: the arrangement chosen once, at initialize.

For each trainable parameter a stage 3 rank owns a *piece*: the elements
``[start, end)`` of the flattened parameter that fall into its slice of the
unit.  The inner optimizer steps the piece's master.  Two arrangements, one
class each (as :mod:`.masters` does for the flat stages):

* :class:`ShardsAreMasters` (fp32 compute): a master is a view of the unit's
  shard itself, as in torch FSDP; nothing is copied after a step, and values
  written into the shard are the masters' values already.
* :class:`SeparateMasters` (fp16/bf16, or any dtype when the shards live in
  files, ``offload_param: {device: nvme}``): a master is an fp32 copy of its piece,
  cast into the shard after each step, and updated when new values are written
  into the unit (``GatheredParameters(modifier_rank=...)``, an in-place write in
  a forward, ``zero.load_state_dict``).

A frozen piece leaves the optimizer; its master and optimizer state are kept
in :attr:`Pieces.frozen` until it trains again.  :meth:`Pieces.master_or_kept`
is the one lookup of "the master, or the kept one while frozen".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

import torch
from torch import nn

from ..distributed import Work
from ..param_state import OptimizerSlot, ParamShard
from .params import Unit
from .store.frozen import FrozenStore, Kept

__all__ = ["InFlight", "NormShare", "Piece", "Pieces", "SeparateMasters", "ShardsAreMasters", "exact_values",
           "piece_sizes"]


class NormShare(NamedTuple):
    """This rank's sum of squared gradients ``sq``, taken as the reduction finished; it holds while every
    ``(master, grad, version)`` in ``seen`` still has ``master.grad is grad`` at that ``grad._version`` (a
    script scaling or replacing the gradients between backward and step makes it stale)."""

    sq: torch.Tensor
    seen: tuple[tuple[torch.Tensor, torch.Tensor, int], ...]


class InFlight(NamedTuple):
    """One unit's reduce-scatter, launched: ``source`` (the unit's local gradients) stays alive until it is
    waited for; ``output`` receives this rank's slice; ``trainable``: the indices of its trainable params."""

    work: Work
    unit: Unit
    source: torch.Tensor
    output: torch.Tensor
    trainable: list[int]


@dataclass(eq=False)
class Piece:
    """The elements ``[start, end)`` of parameter ``index`` of ``unit`` that this rank owns."""

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

    @property
    def name(self) -> str:
        return self.unit.names[self.index]


class Pieces(ABC):
    """This rank's pieces of every unit, with their masters (see the module docstring)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.all: list[Piece] = []
        self.by_unit: dict[Unit, list[Piece]] = {}
        self.by_param: dict[int, list[Piece]] = {}
        #: masters and optimizer state of frozen pieces, kept until they train again
        self.frozen = FrozenStore()
        #: this rank's sum of squared gradients, taken as the reduction finished (None: cleared since)
        self.share: Optional[NormShare] = None

    # ---------------------------------------------------------------- build
    def add(self, unit: Unit, values: torch.Tensor, group_of: dict[int, int]) -> None:
        """This rank's piece of each of ``unit``'s optimizer parameters (``group_of``: id -> param group),
        after ``unit.build``; ``values`` are the unit's full fp32 values, a trainable piece's master starts there."""
        lo = self.rank * unit.shard_numel
        hi = lo + unit.shard_numel
        for index, param in enumerate(unit.params):
            offset = unit.offsets[index]
            start, end = max(lo, offset), min(hi, offset + unit.shapes[index].numel())
            if id(param) not in group_of or start >= end:
                continue
            piece = Piece(unit, index, start - offset, end - offset, start - lo, group_of[id(param)])
            if param.requires_grad:
                piece.master = self._initial_master(piece, values)
            self.all.append(piece)
            self.by_param.setdefault(id(param), []).append(piece)
            self.by_unit.setdefault(unit, []).append(piece)

    @abstractmethod
    def _initial_master(self, piece: Piece, values: torch.Tensor) -> torch.Tensor:
        """The master of a piece trainable at initialize (``values``: the unit's full fp32 values)."""

    @abstractmethod
    def from_shard(self, piece: Piece) -> torch.Tensor:
        """A master made from the piece's elements in the shard (where no fp32 value was kept)."""

    def begin(self, inner: Any, numel: int, sizes: Sequence[int] = ()) -> None:
        """Before the first :meth:`add`: the inner optimizer (None: inference), at most how many elements
        this rank's pieces will hold (an arrangement that keeps them outside memory makes room for them), and
        the sizes of the pieces :meth:`add` will make, in order (:func:`piece_sizes`)."""

    def optimizer_params(self, originals: list[nn.Parameter]) -> list[torch.Tensor]:
        """What the inner optimizer steps in place of the param group ``originals``: the trainable masters."""
        return [piece.master for p in originals for piece in self.by_param.get(id(p), ()) if piece.master is not None]

    # -------------------------------------------------------- trainability
    def refresh(self, state: Any) -> bool:
        """Newly trainable pieces get their master (the kept one, or from the shard); newly frozen ones
        leave the optimizer (``state``), their master and state kept.  True if anything moved."""
        moved = False
        for piece in self.all:
            if piece.param.requires_grad and piece.master is None:
                self._unfreeze(piece, state)
                piece.unit.shard_released()  # read for a master: a shard kept in a file may leave (`max_in_cpu`)
                moved = True
            elif not piece.param.requires_grad and piece.master is not None:
                self._freeze(piece, piece.master, state)
                moved = True
        if moved:
            self.share = None  # a frozen piece's gradient left the sum
        return moved

    def _freeze(self, piece: Piece, master: torch.Tensor, state: Any) -> None:
        kept = Kept(piece.start, piece.end, master)
        kept.slot.set(OptimizerSlot(state, master).get())
        state.pop(master, None)
        self.frozen.keep(piece.param, kept)
        master.grad = None
        piece.master, piece.grad = None, None

    def _unfreeze(self, piece: Piece, state: Any) -> None:
        kept = self.frozen.take(piece.param)
        if kept is None:
            piece.master = self.from_shard(piece)  # frozen at start: the compute dtype is the best there is
            return
        piece.master = kept.master
        if kept.state:
            OptimizerSlot(state, kept.master).set(kept.state)

    def master_or_kept(self, piece: Piece) -> Optional[torch.Tensor]:
        """The piece's master, or the one kept while it is frozen (None: frozen since initialize)."""
        if piece.master is not None:
            return piece.master
        kept = self.frozen.get(piece.param)
        return kept.master if kept is not None else None

    # ------------------------------------------------------------ gradients
    def grads(self) -> list[torch.Tensor]:
        """The masters' gradients (what the optimizer reads)."""
        return [p.master.grad for p in self.all if p.master is not None and p.master.grad is not None]

    def grad_sq(self) -> torch.Tensor:
        """This rank's sum of squared gradients, computed now."""
        return _sum_sq(self.grads())

    def add_reduced(self, flight: InFlight, scale: float) -> None:
        """Wait for ``flight`` and add ``scale`` times this rank's slice of the unit's reduced gradients to the
        gradients of its pieces of the trainable parameters (fp32, allocated by the first add after
        :meth:`zero_grads`).  (Which of them no rank had a gradient for, :meth:`step` is told.)"""
        flight.work.wait()
        self.share = None
        for piece in self.by_unit.get(flight.unit, ()):
            master = piece.master
            if master is None or piece.index not in flight.trainable:
                continue
            reduced = piece.local(flight.output)
            if piece.grad is None:
                piece.grad = reduced.float().mul(scale)
            else:
                piece.grad.add_(reduced, alpha=scale)
            master.grad = piece.grad

    def finish_reduction(self, flights: list[InFlight], scale: float) -> None:
        """The end of a reducing backward: :meth:`add_reduced` for each unit still in flight, then the norm's
        share taken once over the sums (the step reads :attr:`share` while it holds, :class:`NormShare`)."""
        for flight in flights:
            self.add_reduced(flight, scale)
        seen = tuple((p.master, p.master.grad, p.master.grad._version) for p in self.all
                     if p.master is not None and p.master.grad is not None)
        self.share = NormShare(_sum_sq([grad for _, grad, _ in seen]), seen)

    def step(self, inner: Any, factor: float, used: set[tuple[Unit, int]], release: bool) -> None:
        """The optimizer step over this rank's masters, in one call: their gradients multiplied by ``factor``
        (unscale and clip), ``inner`` stepped with the pieces of parameters no rank had a gradient for (their
        ``(unit, index)`` not in ``used``) left alone, as torch leaves a parameter whose ``.grad`` is None (no
        momentum, no weight decay), then the updated masters published into the shards; ``release``: the
        gradients dropped afterwards (:meth:`zero_grads`)."""
        grads = self.grads()
        self.share = None
        if factor != 1.0 and grads:
            torch._foreach_mul_(grads, factor)
        hidden = [(p.master, p.master.grad) for p in self.all
                  if p.master is not None and p.master.grad is not None and (p.unit, p.index) not in used]
        for master, _ in hidden:
            master.grad = None
        try:
            self._step_inner(inner)
        finally:
            for master, grad in hidden:
                master.grad = grad
        if release:
            self.zero_grads()
        self.publish()

    def zero_grads(self) -> None:
        self.share = None
        for piece in self.all:
            piece.grad = None  # the next reduction allocates it again
            if piece.master is not None:
                piece.master.grad = None

    # -------------------------------------------------- values to the model
    def _step_inner(self, inner: Any) -> None:
        """Step the inner optimizer over the trainable masters (an offloaded arrangement steps a part at a time)."""
        inner.step()

    @abstractmethod
    def publish(self) -> None:
        """After a step: the updated masters into the units' shards."""

    def on_params_modified(self, unit: Unit) -> None:
        """New values were scattered into ``unit``'s shard: masters (kept ones too) follow."""
        for piece in self.by_unit.get(unit, ()):
            self._take(piece, piece.local(unit.shard))

    def on_written(self, unit: Unit) -> None:
        """A forward wrote ``unit``'s gathered values in place: this rank's slice becomes its shard and masters.

        Only the parameters whose slice changed are copied, so the fp32 masters of the others keep
        their exact values (a copy from the compute dtype would round them).
        """
        with torch._C.DisableTorchFunctionSubclass():
            fresh = unit.local(unit.full)
            if torch.equal(fresh, unit.shard):
                return
            for piece in self.by_unit.get(unit, ()):
                values = piece.local(fresh)
                if not torch.equal(values, piece.local(unit.shard)):
                    self._take(piece, values)
            unit.shard.copy_(fresh)

    def on_values_loaded(self, unit: Unit, values: torch.Tensor, loaded: set[int]) -> None:
        """``zero.load_state_dict`` gave ``unit`` fp32 ``values``: masters (kept ones too) take them exactly."""
        for piece in self.by_unit.get(unit, ()):
            if piece.index in loaded:
                self._take(piece, piece.local(values))

    def _take(self, piece: Piece, values: torch.Tensor) -> None:
        """The piece's master (or kept master) takes ``values``: new values written into the model."""
        master = self.master_or_kept(piece)
        if master is not None:
            master.copy_(values)

    # ----------------------------------------------------------- accounting
    def held_state_bytes(self) -> int:
        """Bytes of optimizer state held outside the inner optimizer's ``state`` and the kept (frozen) store:
        a partial NVMe offload's resident part."""
        return 0

    @abstractmethod
    def master_bytes(self) -> int:
        """Bytes of master weights held apart from the units' shards (kept ones included)."""

    def fill(self, unit: Unit, shard: torch.Tensor) -> None:
        """Write the masters (kept ones too) of ``unit``'s pieces into ``shard``, a full-precision copy of its shard."""
        for piece in self.by_unit.get(unit, ()):
            master = self.master_or_kept(piece)
            if master is not None:
                piece.local(shard).copy_(master)

    # ----------------------------------------------------------- checkpoint
    def shards(self, state: Any, loading: bool = True) -> list[ParamShard]:
        """One :class:`ParamShard` per trainable piece (``state``: the inner optimizer's; ``loading``: a
        checkpoint load may write through them)."""
        return [
            ParamShard(p.name, p.unit.shapes[p.index], p.start, p.end, p.master, p.group, OptimizerSlot(state, p.master))
            for p in self.all
            if p.master is not None
        ]

    def fresh_kept(self, piece: Piece) -> Kept:
        """A kept entry for a piece frozen since initialize, so a checkpoint load can fill it."""
        return Kept(piece.start, piece.end, self.from_shard(piece))

    def write_kept(self, piece: Piece, kept: Kept) -> None:
        """A loaded kept master into the shard (nothing to copy where it is a view of the shard)."""
        local = piece.local(piece.unit.shard)
        if local.data_ptr() != kept.master.data_ptr():
            local.copy_(kept.master)

    def close(self) -> None:
        """Let go of what the arrangement holds outside memory (files of an offloaded one; ``engine.destroy()``)."""


def _sum_sq(grads: list[torch.Tensor]) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack(torch._foreach_norm(grads)).square().sum()


def exact_values(piece: Piece, values: torch.Tensor) -> torch.Tensor:
    """The piece's exact fp32 values at build: in its unit's shard when that is fp32 (``unit.build`` freed
    ``values`` then, it became the full buffer), else in ``values`` (the unit's full fp32 values)."""
    shard = piece.unit.shard
    if shard.dtype == torch.float32:
        return piece.local(shard)
    return values.narrow(0, piece.unit.offsets[piece.index] + piece.start, piece.numel)


class ShardsAreMasters(Pieces):
    """fp32 compute: a master is a view of its piece of the unit's shard (see the module docstring)."""

    def _initial_master(self, piece: Piece, values: torch.Tensor) -> torch.Tensor:
        # `unit.build` kept exactly these values in the shard, and freed `values` (it became the full buffer)
        return piece.local(piece.unit.shard)

    def from_shard(self, piece: Piece) -> torch.Tensor:
        return piece.local(piece.unit.shard)

    def publish(self) -> None:
        pass  # the optimizer stepped the shards themselves

    def _take(self, piece: Piece, values: torch.Tensor) -> None:
        pass  # every master, kept ones too, is a view of the shard that took the values

    def master_bytes(self) -> int:
        return 0


class SeparateMasters(Pieces):
    """fp16/bf16 compute: a master is an fp32 copy of its piece (see the module docstring)."""

    def _initial_master(self, piece: Piece, values: torch.Tensor) -> torch.Tensor:
        return exact_values(piece, values).clone()  # fp32 too, where the shards live in files

    def from_shard(self, piece: Piece) -> torch.Tensor:
        # a copy even in fp32 (shards kept in files): a view would be the shard's host copy, kept alive past
        # its eviction and no longer the shard
        return piece.local(piece.unit.shard).to(torch.float32, copy=True)

    def publish(self) -> None:
        for unit, pieces in self.by_unit.items():  # a unit at a time: a shard kept in a file goes there unread
            parts = [(p.offset, p.master) for p in pieces if p.master is not None]
            if parts:
                unit.write_shard(parts)
                unit.shard_released()

    def master_bytes(self) -> int:
        masters = [p.master for p in self.all if p.master is not None]
        return sum(m.numel() * m.element_size() for m in masters) + self.frozen.master_bytes()


def piece_sizes(units: Iterable[Sequence[torch.Tensor]], group_of: Mapping[int, int], rank: int, world: int) -> list[int]:
    """The sizes of the pieces :meth:`Pieces.add` makes on ``rank`` of units holding the parameters ``units``,
    in order, before the units are built (as :class:`~.params.Unit` pads and cuts them)."""
    sizes = []
    with torch._C.DisableTorchFunctionSubclass():
        for params in units:
            numels = [p.numel() for p in params]
            total = sum(numels)
            shard = (-(-total // world) * world if total else world) // world
            lo, offset = rank * shard, 0
            for param, numel in zip(params, numels):
                start, end = max(lo, offset), min(lo + shard, offset + numel)
                if id(param) in group_of and start < end:
                    sizes.append(end - start)
                offset += numel
    return sizes
