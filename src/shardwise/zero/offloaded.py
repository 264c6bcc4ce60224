"""Masters offloaded to NVMe: fp32 master weights and optimizer state in files, stepped sub-group by sub-group.

The arrangement beside :class:`~.masters.InPlaceMasters` and
:class:`~.masters.SeparateMasters`, chosen once by
:func:`~.masters.choose_masters` when ``offload_optimizer.device`` is
``nvme``.  The model's parameters live in a flat buffer of the compute dtype
as usual; this rank's masters and optimizer state live in
:class:`~.nvme_files.NvmeFiles`, one file per kind (``master``, ``exp_avg``,
...), each laid out as this rank's shard.  The step
(:meth:`OffloadedMasters.step`) reads a sub-group (:mod:`.offload_plan`) into
a pool buffer, points the inner optimizer's chunk tensors at it, runs torch's
own ``step`` over that sub-group only, publishes the updated values into the
model's flat buffer, and writes the sub-group back while the next one is
stepped (:mod:`.readahead`).

Between steps the inner optimizer's ``state`` is empty and the tensors it
steps hold no memory (zero-stride placeholders); a checkpoint sees each
piece's master and state as memory maps of the files (:class:`NvmeSlot`), so
saving, loading and resharding go through the same
:class:`~shardwise.param_state.ParamShard` as any other arrangement.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, MutableMapping

import torch

from ..distributed import Comm
from ..param_state import StateSlot, is_per_element
from .carry import export_state
from .frozen import Kept
from .grads import ReducedGrads
from .layout import FlatLayout
from .masters_base import Gather, Masters
from .nvme_files import NvmeFiles, OffloadIOError
from .offload_plan import OffloadSpec, plan_sub_groups
from .readahead import BufferPool, pipelined

__all__ = ["NvmeSlot", "OffloadedMasters"]

#: byte alignment of each kind inside a sub-group's buffer (a typed view needs its element size at least)
_ALIGN = 64


def _placeholder(numel: int) -> torch.Tensor:
    """A tensor of ``numel`` elements that holds one (what the optimizer keeps between steps)."""
    return torch.zeros(1).expand(numel)


class OffloadedMasters(Masters):
    """fp32 masters and optimizer state of this rank's shard in files under ``nvme_path``."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device, spec: OffloadSpec) -> None:
        super().__init__(layout, dtype, device)
        self.spec = spec
        self.chunks, self.groups = plan_sub_groups(layout.pieces, spec.sub_group_size)
        self.chunks_of: list[list[int]] = [[] for _ in layout.pieces]
        for index, chunk in enumerate(self.chunks):
            self.chunks_of[chunk.piece].append(index)
        #: the per-element state kinds there are files for
        self.kinds: dict[str, torch.dtype] = {}
        #: per chunk: the kinds it has state in, its other (small) state values, the tensor the optimizer steps
        self.chunk_kinds: list[set[str]] = [set() for _ in self.chunks]
        self.small: list[dict[str, Any]] = [{} for _ in self.chunks]
        self.chunk_keys = [_placeholder(chunk.numel) for chunk in self.chunks]
        #: per piece, the tensor the param group holds (its ``.grad`` is the piece's gradient)
        self.keys: list[torch.Tensor] = []
        largest = max((g.numel for g in self.groups), default=0)
        expected = largest * (4 + spec.state_bytes) + _ALIGN * 4  # master and state, each region aligned
        self.pool = BufferPool(spec.buffer_count, expected, pin=spec.pin_memory and device.type == "cuda")
        #: whether the files may hold masters the model's parameters do not show yet (a checkpoint borrowed them)
        self.stale = False
        #: why the files no longer hold one step's state (a step failed part-way); None while they do
        self.broken: str | None = None
        self.files: NvmeFiles | None = None

    # ------------------------------------------------------------------ build
    def build(self, initial: Mapping[int, torch.Tensor]) -> None:
        self._flatten(self.dtype)
        self.files = NvmeFiles(self.spec.root, self.spec.rank)
        try:
            self._fill(self.files, initial)
        except BaseException:  # refused or failed at initialize: no folder is left behind
            self.files.remove()
            self.files = None
            raise

    def _fill(self, files: NvmeFiles, initial: Mapping[int, torch.Tensor]) -> None:
        """Claim the disk room the state needs, then write the initial fp32 masters."""
        layout, spec = self.layout, self.spec
        numel = layout.shard_numel
        files.reserve(numel * (4 + spec.state_bytes),
                      f"fp32 masters and {spec.state_bytes} bytes of optimizer state for each of {numel:,} elements")
        files.create("master", numel * 4)
        for piece in layout.pieces:
            param = layout.params[piece.param]
            source = initial.get(id(param), param.data).reshape(-1)[piece.start : piece.end]
            files.write_from("master", source.float(), piece.shard_offset * 4, "the initial masters")

    @property
    def _files(self) -> NvmeFiles:
        if self.files is None:
            raise RuntimeError("the offloaded masters were closed (`engine.destroy()` ran); build a new engine")
        return self.files

    def _usable(self, doing: str) -> NvmeFiles:
        """The files, unless a failed step left them half-updated (stepping or saving them would spread that)."""
        if self.broken is not None:
            raise RuntimeError(
                f"rank {self.spec.rank}: cannot {doing}: this engine's offloaded optimizer state is incomplete since "
                f"a step failed part-way ({self.broken}); some sub-groups hold the new step and some the old. "
                "Build a new engine and `load_checkpoint` the last checkpoint")
        return self._files

    def steps(self, grads: ReducedGrads) -> dict[int, torch.Tensor]:
        layout = self.layout
        views: dict[int, torch.Tensor] = {}
        for piece in layout.pieces:
            bucket, _ = layout.bucket_of[piece.param]
            key = _placeholder(piece.numel)
            key.grad = grads.slices[bucket.index].narrow(0, piece.shard_offset - bucket.shard_offset, piece.numel)
            views.setdefault(id(layout.params[piece.param]), key)
        self.keys = [views[id(layout.params[p.param])] for p in layout.pieces]
        return views

    # ------------------------------------------------------------------- step
    def step(self, inner: Any) -> None:
        """One optimizer step over every sub-group: read ahead, step, publish, write behind."""
        self._usable("step")
        kinds = dict(self.kinds)  # what the reads of this step find on disk (the step may add kinds)
        sizes = [self._regions(g.numel, kinds)[-1][2] for g in self.groups]
        owner = {id(p): i for i, group in enumerate(inner.param_groups) for p in group["params"]}
        try:
            pipelined(range(len(self.groups)), sizes, self.pool, lambda g, buffer: self._read(g, buffer, kinds),
                      lambda g, buffer: self._step_group(inner, owner, g, self._views(g, buffer, kinds)))
        except OffloadIOError as exc:
            self.broken = f"{exc.operation} {exc.path} failed"
            raise exc.extended("This step updated part of the offloaded state only: this engine now refuses to "
                               "step or save; restart from the last checkpoint (a new engine and "
                               "`load_checkpoint`)") from exc.__cause__
        except BaseException as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            raise
        self.stale = False  # the step read every piece's master from the files and published it

    @staticmethod
    def _regions(numel: int, kinds: Mapping[str, torch.dtype]) -> list[tuple[str, torch.dtype, int]]:
        """(kind, dtype, end byte) of each kind in a sub-group's buffer, the master first."""
        end, out = 0, []
        for kind, dtype in [("master", torch.float32), *sorted(kinds.items())]:
            end = -(-end // _ALIGN) * _ALIGN + numel * dtype.itemsize
            out.append((kind, dtype, end))
        return out

    def _views(self, g: int, buffer: torch.Tensor, kinds: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
        numel, views = self.groups[g].numel, {}
        for kind, dtype, end in self._regions(numel, kinds):
            size = numel * dtype.itemsize
            views[kind] = buffer.narrow(0, end - size, size).view(dtype)
        return views

    def _where(self, g: int) -> str:
        """Sub-group ``g`` in words, for an I/O error."""
        group = self.groups[g]
        return f"sub-group {g + 1} of {len(self.groups)}: elements {group.start:,}-{group.end:,} of this rank's shard"

    def _read(self, g: int, buffer: torch.Tensor, kinds: Mapping[str, torch.dtype]) -> None:
        start = self.groups[g].start
        for kind, view in self._views(g, buffer, kinds).items():
            self._files.read_into(kind, view, start * view.element_size(), self._where(g))

    def _step_group(self, inner: Any, owner: dict[int, int], g: int, views: dict[str, torch.Tensor]) -> Any:
        group = self.groups[g]
        stepped: list[list[torch.Tensor]] = [[] for _ in inner.param_groups]
        for index in group.chunks:
            key = self._load(inner, index, views, group.start)
            stepped[owner[id(self.keys[self.chunks[index].piece])]].append(key)
        with _only(inner, stepped):
            inner.step()
        fresh = [self._take_state(inner, index, views, group.start) for index in group.chunks]
        self._note_kinds(fresh)
        return lambda: self._write(g, views, fresh)

    def _load(self, inner: Any, index: int, views: dict[str, torch.Tensor], start: int) -> torch.Tensor:
        """Point chunk ``index``'s tensor, gradient and state at the sub-group's buffer."""
        chunk, key = self.chunks[index], self.chunk_keys[index]
        at = chunk.shard_at - start
        key.data = views["master"].narrow(0, at, chunk.numel)
        grad = self.keys[chunk.piece].grad  # None where the step leaves the parameter alone
        key.grad = None if grad is None else grad.narrow(0, chunk.at, chunk.numel)
        entries = dict(self.small[index])
        entries.update({kind: views[kind].narrow(0, at, chunk.numel) for kind in self.chunk_kinds[index]})
        if entries:
            inner.state[key] = entries  # torch keys state by the tensor it steps
        return key

    def _take_state(self, inner: Any, index: int, views: dict[str, torch.Tensor],
                    start: int) -> list[tuple[str, int, torch.Tensor]]:
        """Take chunk ``index``'s state out of the optimizer, publish its master, and let its tensor go.

        Returns the per-element tensors that are not in the buffer already (created by this step)."""
        chunk, key = self.chunks[index], self.chunk_keys[index]
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
        self._owned(chunk.piece).narrow(0, chunk.at, chunk.numel).copy_(key.detach())
        key.data, key.grad = _placeholder(chunk.numel), None
        return fresh

    def _note_kinds(self, fresh: list[list[tuple[str, int, torch.Tensor]]]) -> None:
        """Files for kinds of state the optimizer just created (made here: later writes go into them)."""
        for items in fresh:
            for kind, _, value in items:
                if kind not in self.kinds:
                    self.kinds[kind] = value.dtype
                    self._files.create(kind, self.layout.shard_numel * value.element_size())

    def _write(self, g: int, views: dict[str, torch.Tensor], fresh: list[list[tuple[str, int, torch.Tensor]]]) -> None:
        """On the I/O thread: sub-group ``g``'s buffer back to its files, and state this step created."""
        files, start, where = self._files, self.groups[g].start, self._where(g)
        for kind, view in views.items():
            files.write_from(kind, view, start * view.element_size(), where)
        for items in fresh:
            for kind, shard_at, value in items:
                files.write_from(kind, value, shard_at * value.element_size(), where)

    def _owned(self, index: int) -> torch.Tensor:
        """Piece ``index``'s elements in the model's flat parameter buffer."""
        piece = self.layout.pieces[index]
        return self.layout.param_slice(self.param_flat, piece.param).narrow(0, piece.start, piece.numel)

    # ------------------------------------------------------------- publishing
    def publish(self) -> None:
        self._refresh()  # the step wrote the updated values into this rank's slice already

    def _refresh(self) -> None:
        """After a load wrote the files: their masters into the model's parameters.

        Also after a save (the maps do not say who borrowed them): then it re-reads the masters for nothing,
        but only where the parameters are needed before the next step, which publishes every piece anyway
        (``full_state_dict``).  Holding the maps to tell by their version would keep every page they touched
        resident until the next step."""
        if not self.stale:
            return
        master = self._mapped("master", torch.float32)
        for index, piece in enumerate(self.layout.pieces):
            self._owned(index).copy_(master.narrow(0, piece.shard_offset, piece.numel))
        self.stale = False

    # ------------------------------------------------------------- checkpoint
    def piece(self, index: int, key: torch.Tensor, state: MutableMapping[Any, Any]) -> tuple[torch.Tensor, StateSlot]:
        """Piece ``index``'s master and state slot, as memory maps of its files (writes go to disk)."""
        self._usable("save or load a checkpoint")
        piece = self.layout.pieces[index]
        self.stale = True  # a load writes through the map
        return self._files.mapped_range("master", piece.shard_offset, piece.numel, torch.float32), NvmeSlot(self, index)

    def _mapped(self, kind: str, dtype: torch.dtype) -> torch.Tensor:
        numel = self.layout.shard_numel
        return self._files.mapped(kind, numel, dtype) if numel else torch.zeros(0, dtype=dtype)

    def shard(self) -> torch.Tensor:
        """This rank's fp32 masters, whole (a copy: for full weights and a change of the trainable set)."""
        return self._mapped("master", torch.float32).clone()

    def full(self, gather: Gather) -> dict[int, torch.Tensor]:
        if self.dtype != torch.float32:
            return super().full(gather)
        # fp32: the model's parameters hold the masters' exact values once published; no read, no gather
        self._refresh()
        layout = self.layout
        return {id(p): layout.param_slice(self.param_flat, i).view_as(p).clone() for i, p in enumerate(layout.params)}

    def nbytes(self) -> int:
        """Host bytes of the read-ahead/write-behind buffers (the masters themselves are on disk)."""
        return self.pool.nbytes()

    def export(self, state: MutableMapping[Any, Any], steps: dict[int, torch.Tensor], comm: Comm,
               gather: Gather) -> dict[int, Kept]:
        # A change of the trainable set gathers every parameter's state whole; it is read from disk for that.
        self._usable("change the trainable set")
        for index, key in enumerate(self.keys):
            entries = NvmeSlot(self, index).get()
            if entries:
                state[key] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in entries.items()}
        carried = export_state(self.layout, self.shard(), steps, state, comm, gather)
        state.clear()
        return carried

    def adopt(self, carried: Mapping[int, Kept], state: MutableMapping[Any, Any], steps: dict[int, torch.Tensor]) -> None:
        for index, piece in enumerate(self.layout.pieces):
            entry = carried.get(id(self.layout.params[piece.param]))
            if entry is None:
                continue
            mine = entry.piece(piece.start, piece.end)
            master, slot = self.piece(index, self.keys[index], state)
            master.copy_(mine.master)
            if mine.state:
                slot.set(dict(mine.state))

    def close(self) -> None:
        """Delete this rank's offload folder (``engine.destroy()``; also done at exit)."""
        if self.files is not None:
            self.files.remove()
            self.files = None

    def release(self) -> None:
        super().release()
        self.close()


class NvmeSlot:
    """One offloaded piece's optimizer state: per-element tensors map its files, the rest is its first chunk's."""

    def __init__(self, masters: OffloadedMasters, index: int) -> None:
        self.masters = masters
        self.index = index

    def get(self) -> dict[str, Any]:
        masters = self.masters
        piece, chunks = masters.layout.pieces[self.index], masters.chunks_of[self.index]
        out = dict(masters.small[chunks[0]])
        for kind in sorted(set.intersection(*(masters.chunk_kinds[c] for c in chunks))):
            out[kind] = masters._files.mapped_range(kind, piece.shard_offset, piece.numel, masters.kinds[kind])
        return out

    def set(self, state: dict[str, Any]) -> None:
        masters = self.masters
        piece, chunks = masters.layout.pieces[self.index], masters.chunks_of[self.index]
        per_element = {k: v for k, v in state.items() if is_per_element(v, piece.numel)}
        for chunk in chunks:  # each chunk is stepped as its own tensor: its own copy of `step` and the like
            masters.small[chunk] = {k: _copy(v) for k, v in state.items() if k not in per_element}
            masters.chunk_kinds[chunk] = set(per_element)
        for kind, value in per_element.items():
            if kind not in masters.kinds:
                masters.kinds[kind] = value.dtype
                masters._files.create(kind, masters.layout.shard_numel * value.element_size())
            target = masters._files.mapped_range(kind, piece.shard_offset, piece.numel, masters.kinds[kind])
            target.copy_(value.reshape(-1))


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
