"""Stage 3's pieces with their fp32 masters and optimizer state in files (``offload_optimizer: {device: nvme}``).

The third arrangement of :mod:`.pieces`, beside :class:`~.pieces.ShardsAreMasters` and
:class:`~.pieces.SeparateMasters`, chosen once by :func:`~.pieces_choice.choose_pieces`.  Each of this
rank's pieces gets a run of elements at ``at[piece]`` in a ``master`` file and in one file per kind of
per-element optimizer state (``exp_avg``, ...), all laid out alike, in a folder of this rank's own under
``nvme_path`` (:class:`~.nvme_files.NvmeFiles`).  The tensor the inner optimizer holds for a trainable piece
(``piece.master``) is a placeholder of its size that holds one element; its ``.grad`` is the piece's fp32
gradient, in memory as without offload, so clipping and the unused-parameter rule see it unchanged.

The step (:meth:`OffloadedPieces.step`) cuts the runs into sub-groups (:mod:`.offload_plan`); for each, one
background thread reads master and state into a pool buffer ahead of time, the chunks' tensors are pointed at
it, torch's own ``step`` runs over that sub-group only, the updated masters are cast into their units' shards,
and the thread writes the sub-group back while the next one is stepped: the loop stages 1-2 share
(:mod:`.offload_step`).  What is this arrangement's own: a step passes by the chunks of pieces that are
frozen or have no gradient, and updated masters go into the units' shards, each unit let go once the step
is past it.  Between steps the inner optimizer's ``state`` is empty.

A piece that stops training takes its master and state out of the files into
:attr:`~.pieces.Pieces.frozen` (host memory), as the other arrangements keep them, and puts them back when
it trains again; a checkpoint sees a trainable piece's master and state as memory maps of the files
(:class:`~.offload_step.OffloadSlot`).

With ``offload_optimizer.ratio`` below 1 the first sub-groups' masters and state stay in host memory
(:mod:`.offload_step`); the plan is made in :meth:`OffloadedPieces.begin` from the sizes the pieces will have,
so the files are laid out, and their disk room claimed, for the offloaded elements only.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..param_state import KeptSlot, ParamShard, copy_value
from .layout import Piece as Run
from .nvme_files import NvmeFiles
from .params import Unit
from .pieces import Piece, Pieces, exact_values
from .readahead import BufferPool
from .store.frozen import Kept
from .store.plan import Chunk, OffloadSpec, plan_sub_groups, resident_split, say_split, state_bytes_per_element
from .store.subgroups import OffloadSlot, SubGroupStepper, placeholder, pool_for

__all__ = ["OffloadedPieces"]


class OffloadedPieces(Pieces):
    """fp32 masters and optimizer state of this rank's pieces in files under ``nvme_path``."""

    def __init__(self, rank: int, spec: OffloadSpec) -> None:
        super().__init__(rank)
        self.spec = spec
        #: where each piece's elements start in every file
        self.at: dict[Piece, int] = {}
        #: elements each file is laid out for (at least every piece's), and how many are given out
        self.numel = 0
        self.used = 0
        #: the per-element state kinds there are files for, and their dtype
        self.kinds: dict[str, torch.dtype] = {}
        self.files: Optional[NvmeFiles] = None
        self.pool = BufferPool(0)
        #: the sub-groups, and per chunk what its state is, made before the first piece is added
        self._stepper: Optional[SubGroupStepper] = None
        #: the sizes of the pieces `add` will make, in order (the plan's)
        self._sizes: list[int] = []
        #: each piece's index in the plan
        self._index: dict[Piece, int] = {}
        #: whether the files may hold masters the shards do not show yet (a checkpoint load maps them)
        self.stale = False
        #: the unit the last sub-group published into, which the next may go on with
        self._waiting: list[Unit] = []

    # ------------------------------------------------------------------ build
    def begin(self, inner: Any, numel: int, sizes: Sequence[int] = ()) -> None:
        """Plan the sub-groups of the pieces of ``sizes`` (laid out one after the other), then make this rank's
        folder and its ``master`` file for the offloaded ones of up to ``numel`` elements, once there is room."""
        if inner is None:
            return  # inference: no optimizer, no masters
        self.numel = numel
        state_bytes = state_bytes_per_element(inner)
        self._sizes = list(sizes)
        runs, at = [], 0
        for index, size in enumerate(self._sizes):
            runs.append(Run(index, 0, size, at))
            at += size
        resident = resident_split(runs, self.spec.sub_group_size, self.spec.ratio)
        chunks, groups = plan_sub_groups(runs, self.spec.sub_group_size, resident)
        say_split(self.spec, resident, at, groups)
        self.pool = pool_for(groups, self.spec.buffer_count, state_bytes, resident=resident)
        self._stepper = SubGroupStepper(chunks, groups, self.pool, lambda: self._files, self.kinds, numel, resident)
        offloaded = numel - resident
        files = NvmeFiles(self.spec.root, self.rank)
        # the room every rank of this host on the disk claims, not this rank's alone
        files.reserve(offloaded * (4 + state_bytes), f"fp32 masters and {state_bytes} bytes of "
                      f"optimizer state for each of {offloaded:,} elements")
        files.create("master", offloaded * 4)
        self.files = files

    def add(self, unit: Unit, values: torch.Tensor, group_of: dict[int, int]) -> None:
        first = len(self.all)
        super().add(unit, values, group_of)
        for index, piece in enumerate(self.all[first:], first):
            self.at[piece] = self.used
            self.used += piece.numel
            if self.used > self.numel or index >= len(self._sizes) or self._sizes[index] != piece.numel:
                raise RuntimeError(f"rank {self.rank}: stage 3's offloaded pieces do not match the {self.numel:,} "
                                   "elements and the plan their files were laid out for (a bug in shardwise); "
                                   "please report it")
            if piece.master is not None:  # trainable at initialize: its exact values start its master
                source = exact_values(piece, values)
                self._plan().write("master", self.at[piece], source.float().contiguous())
        self._index = {}

    def _initial_master(self, piece: Piece, values: torch.Tensor) -> torch.Tensor:
        return placeholder(piece.numel)  # the values go to the file (`add`)

    def from_shard(self, piece: Piece) -> torch.Tensor:
        return piece.local(piece.unit.shard).to(torch.float32, copy=True)  # never a view of a host copy

    @property
    def _files(self) -> NvmeFiles:
        if self.files is None:
            raise RuntimeError(f"rank {self.rank}: the offloaded masters were closed (`engine.destroy()` ran); "
                               "build a new engine")
        return self.files

    def _plan(self) -> SubGroupStepper:
        """The sub-groups of every piece's run and the step over them (planned in :meth:`begin`)."""
        if self._stepper is None:
            raise RuntimeError(f"rank {self.rank}: the offloaded pieces were used before `begin` planned them "
                               "(a bug in shardwise); please report it")
        return self._stepper

    def _planned(self) -> SubGroupStepper:
        """:meth:`_plan`, once every piece is added."""
        if len(self._index) != len(self.all):
            if len(self.all) != len(self._sizes):
                raise RuntimeError(f"rank {self.rank}: {len(self.all)} offloaded pieces were added of the "
                                   f"{len(self._sizes)} planned (a bug in shardwise); please report it")
            self._index = {piece: index for index, piece in enumerate(self.all)}
        return self._plan()

    @property
    def resident(self) -> int:
        """Elements of this rank's pieces whose master and state stay in host memory (``ratio`` below 1)."""
        return self._stepper.resident if self._stepper is not None else 0

    def _slot(self, piece: Piece) -> OffloadSlot:
        """The piece's optimizer state, as memory maps of its files and its chunks' small values."""
        stepper = self._planned()
        return OffloadSlot(stepper, self._index[piece], piece.numel, lambda kind: self.region(kind, piece))

    # -------------------------------------------------------- trainability
    def _freeze(self, piece: Piece, master: torch.Tensor, state: Any) -> None:
        self._planned().check_whole("change the trainable set")
        kept_state = {k: copy_value(v) for k, v in self._slot(piece).get().items()}
        self.frozen.keep(piece.param, Kept(piece.start, piece.end, self.region("master", piece).clone(),
                                           KeptSlot(kept_state)))
        self._forget_state(piece)
        master.grad = None
        piece.master, piece.grad = None, None

    def _unfreeze(self, piece: Piece, state: Any) -> None:
        self._planned().check_whole("change the trainable set")
        kept = self.frozen.take(piece.param)
        self.region("master", piece).copy_(kept.master if kept is not None else self.from_shard(piece))
        self._forget_state(piece)
        if kept is not None and kept.state:
            self._slot(piece).set(kept.state)
        piece.master = placeholder(piece.numel)

    def _forget_state(self, piece: Piece) -> None:
        stepper = self._planned()
        stepper.forget(self._index[piece])

    # ------------------------------------------------------------------- step
    def _step_inner(self, inner: Any) -> None:
        """One optimizer step over every sub-group with something to step: read ahead, step, publish, write behind."""
        self.publish()  # after a load: the files' masters into the shards first
        self._release_published([])  # (a unit a failed step left pinned)
        self._planned().step(inner, self)
        self._release_published([])

    def stepped(self, chunk: Chunk) -> Optional[torch.Tensor]:
        """The chunk's master where its piece trains and has a gradient this step (else torch would leave it
        alone: the step passes it by, and a sub-group of such chunks only is neither read nor written)."""
        master = self.all[chunk.piece].master
        return master if master is not None and master.grad is not None else None

    def publish_sub_group(self, updated: list[tuple[Chunk, torch.Tensor]]) -> None:
        """The updated masters cast into their units' shards; units the step is past may let theirs go."""
        parts: dict[Unit, list[tuple[int, torch.Tensor]]] = {}  # per unit, in shard order: one write each
        for chunk, master in updated:
            piece = self.all[chunk.piece]
            parts.setdefault(piece.unit, []).append((piece.offset + chunk.at, master))
        for unit, written in parts.items():
            unit.write_shard(written)  # an offloaded shard: into its file, unread
        self._release_published(list(parts))

    def _release_published(self, units: list[Unit]) -> None:
        """Units whose masters are all published may let their shards leave host memory (an offloaded shard);
        the last one may go on into the next sub-group, so it waits (read and written once a step, not twice)."""
        waiting = units[-1:]
        done = [unit for unit in dict.fromkeys([*self._waiting, *units]) if unit not in waiting]
        for unit in waiting:
            unit.pin_shard(True)  # before any release below lets the cache choose what leaves
        for unit in done:
            unit.pin_shard(False)
            unit.shard_released()
        self._waiting = waiting

    # ------------------------------------------------- values to the model
    def publish(self) -> None:
        """The step casts each sub-group's masters into the shards as it goes; after a load, all of them."""
        if not self.stale:
            return
        for unit, pieces in self.by_unit.items():
            unit.write_shard([(p.offset, self.region("master", p)) for p in pieces if p.master is not None])
            unit.shard_released()
        self.stale = False

    def master_or_kept(self, piece: Piece) -> Optional[torch.Tensor]:
        """A trainable piece's master is its region of the files (``piece.master`` is the optimizer's key)."""
        return self.region("master", piece) if piece.master is not None else super().master_or_kept(piece)

    # ----------------------------------------------------------- accounting
    def master_bytes(self) -> int:
        """Host bytes of the read-ahead/write-behind buffers, resident and kept masters (the others are on disk)."""
        resident = self._stepper.memory_bytes(master=True) if self._stepper is not None else 0
        return self.pool.nbytes() + resident + self.frozen.master_bytes()

    def held_state_bytes(self) -> int:
        """Host bytes of the resident sub-groups' optimizer state."""
        return self._stepper.memory_bytes(master=False) if self._stepper is not None else 0

    # ----------------------------------------------------------- checkpoint
    def region(self, kind: str, piece: Piece) -> torch.Tensor:
        """The piece's elements of ``kind``: a memory map of its file, or a view of host memory where the piece is
        resident (writes go there)."""
        dtype = self.kinds.get(kind, torch.float32)
        return self._planned().region(kind, self.at[piece], piece.numel, dtype)

    def shards(self, state: Any, loading: bool = True) -> list[ParamShard]:
        """Each trainable piece's master and state as memory maps of the files (a load writes through them)."""
        self._planned().check_whole("save or load a checkpoint")
        self.stale = self.stale or loading  # the loaded masters reach the shards at the next publish
        return [ParamShard(p.name, p.unit.shapes[p.index], p.start, p.end, self.region("master", p), p.group,
                           self._slot(p))
                for p in self.all if p.master is not None]

    def close(self) -> None:
        """Delete this rank's offload folder (``engine.destroy()``; also done at exit)."""
        if self.files is not None:
            self.files.remove()
            self.files = None
        if self._stepper is not None:
            self._stepper.memory.clear()
