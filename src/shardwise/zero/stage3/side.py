"""Stage 3's side of the master store: a piece's values are in its unit's shard.

For each of its optimizer's parameters a stage 3 rank owns a *piece*: the elements ``[start, end)`` of the
flattened parameter that fall into its slice of the unit (:meth:`UnitSide.pieces`), laid one after the
other in this rank's shard of the store.  In fp32 with the shards in memory the store's masters are views
of the shards themselves, as in torch FSDP: nothing is copied after a step, and values written into a
shard are the masters' values already.  Otherwise (fp16/bf16, or shards kept in a file,
``offload_param: {device: nvme}``, where a view would leave host memory with the shard) the masters are
apart, and updated ones are cast into the shards a unit at a time (:meth:`UnitSide.write`): a shard kept in
a file takes them there, unread, and may leave host memory once the step is past it.

Values written into the units that did not come from a step (``GatheredParameters(modifier_rank=...)``, an
in-place write in a forward, ``zero.load_state_dict``) reach the masters, kept ones too, through this side:
it is the gatherer's :class:`~.hooks.MasterValues`.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Sequence

import torch

from ..store.home import Piece, Run, Runs
from ..store.store import MasterStore
from .params import Unit

__all__ = ["UnitSide", "piece_runs"]


class UnitSide:
    """This rank's pieces of stage 3's units (see the module docstring); ``in_files``: the shards live in a file."""

    def __init__(self, rank: int, in_files: bool) -> None:
        self.rank = rank
        self.in_files = in_files
        #: the store whose masters follow the values written into the units (set once it is made)
        self.store: MasterStore
        self.by_unit: dict[Unit, list[Piece]] = {}
        #: elements of this rank's shard given out to pieces so far
        self.numel = 0
        #: the unit the last write went into, which the next may go on with
        self._waiting: list[Unit] = []

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
        ``values`` then, it became the full buffer), else in ``values`` (the unit's full fp32 values)."""
        shard = piece.unit.shard
        if shard.dtype == torch.float32:
            return _local(piece, shard)
        return values.narrow(0, piece.unit.offsets[piece.index] + piece.start, piece.numel)

    # ------------------------------------------------------------ the store's side
    def view(self, piece: Piece) -> Optional[torch.Tensor]:
        return None if self.in_files else _local(piece, piece.unit.shard)

    def values(self, piece: Piece) -> torch.Tensor:
        # a copy even in fp32: a view of a shard kept in a file would be its host copy, kept alive past its
        # eviction and no longer the shard
        values = _local(piece, piece.unit.shard).to(torch.float32, copy=True)
        piece.unit.shard_released()  # only read: a shard kept in a file may leave (`max_in_cpu`)
        return values

    def write(self, runs: Runs) -> None:
        """Cast into the units' shards, one write per unit (a shard kept in a file and not in memory takes them
        in the file, unread); units the write is past may let their shards go."""
        parts: dict[Unit, list[tuple[int, torch.Tensor]]] = {}  # per unit, in shard order
        for piece, at, values in runs:
            parts.setdefault(piece.unit, []).append((piece.offset + at, values))
        for unit, written in parts.items():
            unit.write_shard(written)
        self._release(list(parts))

    def settle(self) -> None:
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

    # ---------------------------------------------------- values written into the units
    def on_params_modified(self, unit: Unit) -> None:
        """New values were scattered into ``unit``'s shard: masters (kept ones too) follow."""
        for piece in self.by_unit.get(unit, ()):
            self.store.take(piece, _local(piece, unit.shard))

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
                values = _local(piece, fresh)
                if not torch.equal(values, _local(piece, unit.shard)):
                    self.store.take(piece, values)
            unit.shard.copy_(fresh)

    def on_values_loaded(self, unit: Unit, values: torch.Tensor, loaded: set[int]) -> None:
        """``zero.load_state_dict`` gave ``unit`` fp32 ``values``: masters (kept ones too) take them exactly."""
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
