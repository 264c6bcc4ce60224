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
and the thread writes the sub-group back while the next one is stepped (:mod:`.readahead`).  Between steps
the inner optimizer's ``state`` is empty.

A piece that stops training takes its master and state out of the files into
:attr:`~.pieces.Pieces.frozen` (host memory), as the other arrangements keep them, and puts them back when
it trains again; a checkpoint sees a trainable piece's master and state as memory maps of the files
(:class:`PieceSlot`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Optional

import torch

from ..param_state import KeptSlot, ParamShard, is_per_element
from .frozen import Kept
from .layout import Piece as Run
from .nvme_files import NvmeFiles
from .offload_plan import Chunk, OffloadSpec, SubGroup, plan_sub_groups, state_bytes_per_element
from .params import Unit
from .pieces import Piece, Pieces, exact_values
from .readahead import BufferPool, pipelined

__all__ = ["OffloadedPieces", "PieceSlot"]

#: byte alignment of each kind inside a sub-group's buffer (a typed view needs its element size at least)
_ALIGN = 64


def _placeholder(numel: int) -> torch.Tensor:
    """A tensor of ``numel`` elements that holds one: what the optimizer holds for a piece between steps."""
    return torch.zeros(1).expand(numel)


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
        self.state_bytes = spec.state_bytes
        #: the per-element state kinds there are files for, and their dtype
        self.kinds: dict[str, torch.dtype] = {}
        self.files: Optional[NvmeFiles] = None
        self.pool = BufferPool(0)
        #: the plan, made once every piece is added: chunks, sub-groups, and per chunk what its state is
        self._plan: Optional[tuple[list[Chunk], list[SubGroup]]] = None
        self.chunks_of: dict[Piece, list[int]] = {}
        self.chunk_kinds: list[set[str]] = []
        self.small: list[dict[str, Any]] = []
        self.chunk_keys: list[torch.Tensor] = []
        #: whether the files may hold masters the shards do not show yet (a checkpoint load maps them)
        self.stale = False
        #: the unit the last sub-group published into, which the next may go on with
        self._waiting: list[Unit] = []

    # ------------------------------------------------------------------ build
    def begin(self, inner: Any, numel: int) -> None:
        """Make this rank's folder and its ``master`` file for up to ``numel`` elements, once there is room."""
        if inner is None:
            return  # inference: no optimizer, no masters
        self.numel = numel
        self.state_bytes = state_bytes_per_element(inner)
        files = NvmeFiles(self.spec.root, self.rank)
        try:  # the room every rank of this host on the disk claims, not this rank's alone
            files.reserve(numel * (4 + self.state_bytes),
                          f"fp32 masters and {self.state_bytes} bytes of optimizer state for each of {numel:,} elements")
        except RuntimeError:
            files.remove()
            raise
        files.create("master", numel * 4)
        self.files = files

    def add(self, unit: Unit, values: torch.Tensor, group_of: dict[int, int]) -> None:
        first = len(self.all)
        super().add(unit, values, group_of)
        for piece in self.all[first:]:
            self.at[piece] = self.used
            self.used += piece.numel
            if self.used > self.numel:
                raise RuntimeError(f"rank {self.rank}: stage 3's offloaded pieces outgrew the {self.numel:,} elements "
                                   "their files were laid out for (a bug in shardwise); please report it")
            if piece.master is not None:  # trainable at initialize: its exact values start its master
                source = exact_values(piece, values)
                self._files.write_from("master", source.float().contiguous(), self.at[piece] * 4)
        self._plan = None

    def _initial_master(self, piece: Piece, values: torch.Tensor) -> torch.Tensor:
        return _placeholder(piece.numel)  # the values go to the file (`add`)

    def from_shard(self, piece: Piece) -> torch.Tensor:
        return piece.local(piece.unit.shard).float()

    @property
    def _files(self) -> NvmeFiles:
        if self.files is None:
            raise RuntimeError(f"rank {self.rank}: the offloaded masters were closed (`engine.destroy()` ran); "
                               "build a new engine")
        return self.files

    def _planned(self) -> tuple[list[Chunk], list[SubGroup]]:
        """Chunks and sub-groups of every piece's run, made once the pieces are known."""
        if self._plan is None:
            runs = [Run(index, piece.start, piece.end, self.at[piece]) for index, piece in enumerate(self.all)]
            chunks, groups = plan_sub_groups(runs, self.spec.sub_group_size)
            self.chunks_of = {piece: [] for piece in self.all}
            for index, chunk in enumerate(chunks):
                self.chunks_of[self.all[chunk.piece]].append(index)
            self.chunk_kinds = [set() for _ in chunks]
            self.small = [{} for _ in chunks]
            self.chunk_keys = [_placeholder(chunk.numel) for chunk in chunks]
            largest = max((g.numel for g in groups), default=0)
            self.pool = BufferPool(self.spec.buffer_count, largest * (4 + self.state_bytes) + _ALIGN * 4)
            self._plan = chunks, groups
        return self._plan

    # -------------------------------------------------------- trainability
    def _freeze(self, piece: Piece, master: torch.Tensor, state: Any) -> None:
        kept_state = {k: _copy(v) for k, v in PieceSlot(self, piece).get().items()}
        self.frozen.keep(piece.param, Kept(piece.start, piece.end, self.region("master", piece).clone(),
                                           KeptSlot(kept_state)))
        self._forget_state(piece)
        master.grad = None
        piece.master, piece.grad = None, None

    def _unfreeze(self, piece: Piece, state: Any) -> None:
        kept = self.frozen.take(piece.param)
        self.region("master", piece).copy_(kept.master if kept is not None else self.from_shard(piece))
        self._forget_state(piece)
        if kept is not None and kept.state:
            PieceSlot(self, piece).set(kept.state)
        piece.master = _placeholder(piece.numel)

    def _forget_state(self, piece: Piece) -> None:
        self._planned()
        for chunk in self.chunks_of[piece]:
            self.chunk_kinds[chunk], self.small[chunk] = set(), {}

    # ------------------------------------------------------------------- step
    def _step_inner(self, inner: Any) -> None:
        """One optimizer step over every sub-group with something to step: read ahead, step, publish, write behind."""
        self.publish()  # after a load: the files' masters into the shards first
        self._release_published([])  # (a unit a failed step left pinned)
        chunks, groups = self._planned()
        kinds = dict(self.kinds)  # what the reads of this step find on disk (the step may add kinds)
        sizes = [_regions(g.numel, kinds)[-1][2] for g in groups]
        order = [g.index for g in groups if any(self._steps(chunks[c]) for c in g.chunks)]
        pipelined(order, sizes, self.pool, lambda g, buffer: self._read(groups[g], buffer, kinds),
                  lambda g, buffer: self._step_group(inner, groups[g], _views(groups[g].numel, buffer, kinds)))
        self._release_published([])

    def _steps(self, chunk: Chunk) -> bool:
        """Whether the chunk's piece trains and has a gradient this step (else torch would leave it alone)."""
        master = self.all[chunk.piece].master
        return master is not None and master.grad is not None

    def _read(self, group: SubGroup, buffer: torch.Tensor, kinds: Mapping[str, torch.dtype]) -> None:
        for kind, view in _views(group.numel, buffer, kinds).items():
            self._files.read_into(kind, view, group.start * view.element_size())

    def _step_group(self, inner: Any, group: SubGroup, views: dict[str, torch.Tensor]) -> Any:
        chunks = self._planned()[0]
        stepped: list[list[torch.Tensor]] = [[] for _ in inner.param_groups]
        loaded = [c for c in group.chunks if self._steps(chunks[c])]
        for index in loaded:
            stepped[self.all[chunks[index].piece].group].append(self._load(inner, index, views, group.start))
        with _only(inner, stepped):
            inner.step()
        fresh = [self._take_state(inner, index, views, group.start) for index in loaded]
        self._note_kinds(fresh)
        self._release_published([self.all[chunks[index].piece].unit for index in loaded])
        return lambda: self._write(group, views, fresh)

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

    def _load(self, inner: Any, index: int, views: dict[str, torch.Tensor], start: int) -> torch.Tensor:
        """Point chunk ``index``'s tensor, gradient and state at the sub-group's buffer."""
        chunk, key = self._planned()[0][index], self.chunk_keys[index]
        at = chunk.shard_at - start
        master = self.all[chunk.piece].master
        assert master is not None and master.grad is not None  # `_steps` chose it
        key.data = views["master"].narrow(0, at, chunk.numel)
        key.grad = master.grad.narrow(0, chunk.at, chunk.numel)
        entries = dict(self.small[index])
        entries.update({kind: views[kind].narrow(0, at, chunk.numel) for kind in self.chunk_kinds[index]})
        if entries:
            inner.state[key] = entries  # torch keys state by the tensor it steps
        return key

    def _take_state(self, inner: Any, index: int, views: dict[str, torch.Tensor],
                    start: int) -> list[tuple[str, int, torch.Tensor]]:
        """Take chunk ``index``'s state out of the optimizer, cast its master into the shard, let its tensor go.

        Returns the per-element tensors that are not in the buffer already (created by this step)."""
        chunk, key = self._planned()[0][index], self.chunk_keys[index]
        at = chunk.shard_at - start
        entries = inner.state.pop(key, {})
        self.small[index] = {k: v for k, v in entries.items() if not is_per_element(v, chunk.numel)}
        fresh = []
        for kind, value in entries.items():
            if not is_per_element(value, chunk.numel):
                continue
            self.chunk_kinds[index].add(kind)
            where = views.get(kind)
            if where is None or where.narrow(0, at, chunk.numel).data_ptr() != value.data_ptr():
                fresh.append((kind, chunk.shard_at, value.detach().reshape(-1)))
        piece = self.all[chunk.piece]
        piece.unit.write_shard([(piece.offset + chunk.at, key.detach())])  # an offloaded shard: into its file, unread
        key.data, key.grad = _placeholder(chunk.numel), None
        return fresh

    def _note_kinds(self, fresh: list[list[tuple[str, int, torch.Tensor]]]) -> None:
        """Files for kinds of state the optimizer just created (made here: later writes go into them)."""
        for items in fresh:
            for kind, _, value in items:
                self._kind_file(kind, value.dtype)

    def _kind_file(self, kind: str, dtype: torch.dtype) -> None:
        if kind not in self.kinds:
            self.kinds[kind] = dtype
            self._files.create(kind, self.numel * dtype.itemsize)

    def _write(self, group: SubGroup, views: dict[str, torch.Tensor],
               fresh: list[list[tuple[str, int, torch.Tensor]]]) -> None:
        """On the I/O thread: the sub-group's buffer back to its files, then the state this step created."""
        files = self._files
        for kind, view in views.items():
            files.write_from(kind, view, group.start * view.element_size())
        for items in fresh:
            for kind, at, value in items:
                files.write_from(kind, value, at * value.element_size())

    # ------------------------------------------------- values to the model
    def publish(self) -> None:
        """The step casts each sub-group's masters into the shards as it goes; after a load, all of them."""
        if not self.stale:
            return
        for unit, pieces in self.by_unit.items():
            unit.write_shard([(p.offset, self.region("master", p)) for p in pieces if p.master is not None])
            unit.shard_released()
        self.stale = False

    def _take(self, piece: Piece, values: torch.Tensor) -> None:
        if piece.master is not None:
            self.region("master", piece).copy_(values)
            return
        kept = self.frozen.get(piece.param)
        if kept is not None:
            kept.master.copy_(values)

    def fill(self, unit: Unit, shard: torch.Tensor) -> None:
        for piece in self.by_unit.get(unit, ()):
            if piece.master is not None:
                piece.local(shard).copy_(self.region("master", piece))
            elif (kept := self.frozen.get(piece.param)) is not None:
                piece.local(shard).copy_(kept.master)

    # ----------------------------------------------------------- accounting
    def master_bytes(self) -> int:
        """Host bytes of the read-ahead/write-behind buffers and kept masters (the others are on disk)."""
        return self.pool.nbytes() + self.frozen.master_bytes()

    # ----------------------------------------------------------- checkpoint
    def region(self, kind: str, piece: Piece) -> torch.Tensor:
        """The piece's elements of file ``kind``, as a memory map (writes go to the file)."""
        dtype = self.kinds.get(kind, torch.float32)
        return self._files.mapped(kind, self.numel, dtype).narrow(0, self.at[piece], piece.numel)

    def shards(self, state: Any, loading: bool = True) -> list[ParamShard]:
        """Each trainable piece's master and state as memory maps of the files (a load writes through them)."""
        self.stale = self.stale or loading  # the loaded masters reach the shards at the next publish
        return [ParamShard(p.name, p.unit.shapes[p.index], p.start, p.end, self.region("master", p), p.group,
                           PieceSlot(self, p))
                for p in self.all if p.master is not None]

    def close(self) -> None:
        """Delete this rank's offload folder (``engine.destroy()``; also done at exit)."""
        if self.files is not None:
            self.files.remove()
            self.files = None


class PieceSlot:
    """One offloaded piece's optimizer state: per-element tensors map its files, the rest is its first chunk's."""

    def __init__(self, pieces: OffloadedPieces, piece: Piece) -> None:
        self.pieces = pieces
        self.piece = piece

    def get(self) -> dict[str, Any]:
        pieces = self.pieces
        pieces._planned()
        chunks = pieces.chunks_of[self.piece]
        out = dict(pieces.small[chunks[0]])
        for kind in sorted(set.intersection(*(pieces.chunk_kinds[c] for c in chunks))):
            out[kind] = pieces.region(kind, self.piece)
        return out

    def set(self, state: dict[str, Any]) -> None:
        pieces, piece = self.pieces, self.piece
        pieces._planned()
        per_element = {k: v for k, v in state.items() if is_per_element(v, piece.numel)}
        for chunk in pieces.chunks_of[piece]:  # each chunk is stepped as its own tensor: its own `step` and the like
            pieces.small[chunk] = {k: _copy(v) for k, v in state.items() if k not in per_element}
            pieces.chunk_kinds[chunk] = set(per_element)
        for kind, value in per_element.items():
            pieces._kind_file(kind, value.dtype)
            pieces.region(kind, piece).copy_(value.reshape(-1))


def _regions(numel: int, kinds: Mapping[str, torch.dtype]) -> list[tuple[str, torch.dtype, int]]:
    """(kind, dtype, end byte) of each kind in a sub-group's buffer, the master first, each region aligned."""
    end, out = 0, []
    for kind, dtype in [("master", torch.float32), *sorted(kinds.items())]:
        end = -(-end // _ALIGN) * _ALIGN + numel * dtype.itemsize
        out.append((kind, dtype, end))
    return out


def _views(numel: int, buffer: torch.Tensor, kinds: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
    views = {}
    for kind, dtype, end in _regions(numel, kinds):
        size = numel * dtype.itemsize
        views[kind] = buffer.narrow(0, end - size, size).view(dtype)
    return views


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


@contextlib.contextmanager
def _only(inner: Any, stepped: list[list[torch.Tensor]]) -> Iterator[None]:
    """Param group ``i`` holds only ``stepped[i]`` (hyperparameters untouched), then all its tensors again."""
    saved = [group["params"] for group in inner.param_groups]
    for group, tensors in zip(inner.param_groups, stepped):
        group["params"] = tensors
    try:
        yield
    finally:
        for group, params in zip(inner.param_groups, saved):
            group["params"] = params
