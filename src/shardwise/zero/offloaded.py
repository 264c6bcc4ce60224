"""Masters offloaded to NVMe: fp32 master weights and optimizer state in files, stepped sub-group by sub-group.

The arrangement beside :class:`~.masters.InPlaceMasters` and
:class:`~.masters.SeparateMasters`, chosen once by
:func:`~.masters.choose_masters` when ``offload_optimizer.device`` is
``nvme``.  The model's parameters live in a flat buffer of the compute dtype
as usual; this rank's masters and optimizer state live in
:class:`~.nvme_files.NvmeFiles`, one file per sub-group and kind
(``g3.master``, ``g3.exp_avg``, ...).  The step (:meth:`OffloadedMasters.step`)
reads a sub-group into a pool buffer, points the inner optimizer's tensors at
it, runs torch's own ``step`` over that sub-group only, publishes the updated
values into the model's flat buffer, and writes the sub-group back while the
next one is stepped (:mod:`.readahead`).

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
from .layout import Bucket, FlatLayout
from .masters_base import Gather, Masters
from .nvme_files import NvmeFiles, check_room
from .offload_plan import OffloadSpec, SubGroup, plan_sub_groups
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
        self.groups: list[SubGroup] = plan_sub_groups(layout.pieces, spec.sub_group_size)
        self.group_of = {p: (g.index, off) for g in self.groups for p, off in zip(g.pieces, g.offsets)}
        #: per sub-group, the per-element state kinds it has files for
        self.kinds: list[dict[str, torch.dtype]] = [{} for _ in self.groups]
        #: per piece, its per-element state kinds and its other (small) state values, kept in memory
        self.piece_kinds: list[set[str]] = [set() for _ in layout.pieces]
        self.small: list[dict[str, Any]] = [{} for _ in layout.pieces]
        self.keys: list[torch.Tensor] = []
        largest = max((g.numel for g in self.groups), default=0)
        expected = largest * (4 + spec.state_bytes) + _ALIGN * 4  # master and state, each region aligned
        self.pool = BufferPool(spec.buffer_count, expected, pin=spec.pin_memory and device.type == "cuda")
        #: whether the files may hold masters the model's parameters do not show yet (after a load)
        self.stale = False
        self.files: NvmeFiles | None = None

    # ------------------------------------------------------------------ build
    def build(self, initial: Mapping[int, torch.Tensor]) -> None:
        layout, spec = self.layout, self.spec
        self._flatten(self.dtype)
        self.files = NvmeFiles(spec.root, spec.rank)
        numel = layout.shard_numel
        try:
            check_room(str(self.files.folder), numel * (4 + spec.state_bytes), spec.rank,
                       f"fp32 masters and {spec.state_bytes} bytes of optimizer state for each of {numel:,} elements")
        except RuntimeError:
            self.files.remove()
            raise
        for group in self.groups:
            master = torch.empty(group.numel, dtype=torch.float32)
            for index, at in zip(group.pieces, group.offsets):
                piece = layout.pieces[index]
                param = layout.params[piece.param]
                source = initial.get(id(param), param.data).reshape(-1)
                master.narrow(0, at, piece.numel).copy_(source[piece.start : piece.end])
            self._files.create(f"g{group.index}.master", group.numel * 4)
            self._files.write_from(f"g{group.index}.master", master)

    @property
    def _files(self) -> NvmeFiles:
        if self.files is None:
            raise RuntimeError("the offloaded masters were closed (`engine.destroy()` ran); build a new engine")
        return self.files

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
        sizes = [self._regions(g)[-1][2] for g in range(len(self.groups))]
        pipelined(range(len(self.groups)), sizes, self.pool, self._read,
                  lambda g, buffer: self._step_group(inner, g, buffer))
        self.stale = False

    def _regions(self, g: int) -> list[tuple[str, torch.dtype, int]]:
        """(kind, dtype, end byte) of each kind in sub-group ``g``'s buffer, the master first."""
        numel, end, out = self.groups[g].numel, 0, []
        for kind, dtype in [("master", torch.float32), *sorted(self.kinds[g].items())]:
            start = -(-end // _ALIGN) * _ALIGN
            end = start + numel * dtype.itemsize
            out.append((kind, dtype, end))
        return out

    def _views(self, g: int, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        numel, views = self.groups[g].numel, {}
        for kind, dtype, end in self._regions(g):
            size = numel * dtype.itemsize
            views[kind] = buffer.narrow(0, end - size, size).view(dtype)
        return views

    def _read(self, g: int, buffer: torch.Tensor) -> None:
        for kind, view in self._views(g, buffer).items():
            self._files.read_into(f"g{g}.{kind}", view)

    def _step_group(self, inner: Any, g: int, buffer: torch.Tensor) -> Any:
        group, views = self.groups[g], self._views(g, buffer)
        stepped = []
        for index, at in zip(group.pieces, group.offsets):
            key, numel = self.keys[index], self.layout.pieces[index].numel
            key.data = views["master"].narrow(0, at, numel)
            entries = dict(self.small[index])
            entries.update({kind: views[kind].narrow(0, at, numel) for kind in self.piece_kinds[index]})
            if entries:
                inner.state[key] = entries
            stepped.append(key)
        with _only(inner, stepped):
            inner.step()
        fresh = [self._take_state(inner, index, at, views) for index, at in zip(group.pieces, group.offsets)]
        new_kinds = self._note_kinds(g, fresh)
        return lambda: self._write(g, views, fresh, new_kinds)

    def _take_state(self, inner: Any, index: int, at: int,
                    views: dict[str, torch.Tensor]) -> list[tuple[str, int, torch.Tensor]]:
        """Take piece ``index``'s state out of the optimizer, publish its master, and let its key go.

        Returns the per-element tensors that are not in the buffer already (created by this step)."""
        key, piece = self.keys[index], self.layout.pieces[index]
        entries = inner.state.pop(key, {})
        self.small[index] = {k: v for k, v in entries.items() if not is_per_element(v, piece.numel)}
        fresh = []
        for kind, value in entries.items():
            if not is_per_element(value, piece.numel):
                continue
            self.piece_kinds[index].add(kind)
            where = views.get(kind)
            if where is None or where.narrow(0, at, piece.numel).data_ptr() != value.data_ptr():
                fresh.append((kind, at, value.detach().reshape(-1)))
        self._owned(index).copy_(key.detach())
        key.data = _placeholder(piece.numel)
        return fresh

    def _note_kinds(self, g: int, fresh: list[list[tuple[str, int, torch.Tensor]]]) -> list[str]:
        new = sorted({kind for items in fresh for kind, _, _ in items} - set(self.kinds[g]))
        for kind in new:
            self.kinds[g][kind] = next(v.dtype for items in fresh for k, _, v in items if k == kind)
        return new

    def _write(self, g: int, views: dict[str, torch.Tensor], fresh: list[list[tuple[str, int, torch.Tensor]]],
               new_kinds: list[str]) -> None:
        """On the I/O thread: sub-group ``g``'s buffer back to its files, and state this step created."""
        files, numel = self._files, self.groups[g].numel
        for kind in new_kinds:
            files.create(f"g{g}.{kind}", numel * self.kinds[g][kind].itemsize)
        for kind, view in views.items():
            files.write_from(f"g{g}.{kind}", view)
        for items in fresh:
            for kind, at, value in items:
                files.write_from(f"g{g}.{kind}", value, at * value.element_size())

    def _owned(self, index: int) -> torch.Tensor:
        """Piece ``index``'s elements in the model's flat parameter buffer."""
        piece = self.layout.pieces[index]
        return self.layout.param_slice(self.param_flat, piece.param).narrow(0, piece.start, piece.numel)

    # ------------------------------------------------------------- publishing
    def gather_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self._refresh()
        return super().gather_pairs()

    def _published(self, bucket: Bucket) -> torch.Tensor:
        return self.layout.owned_slice(self.param_flat, bucket)  # the step wrote the updated values there

    def copy_into_params(self) -> None:
        self._refresh()

    def _refresh(self) -> None:
        """After a load wrote the files: their masters into the model's parameters, a sub-group at a time."""
        if not self.stale:
            return
        for group in self.groups:
            master = self._mapped(group.index, "master", torch.float32)
            for index, at in zip(group.pieces, group.offsets):
                self._owned(index).copy_(master.narrow(0, at, self.layout.pieces[index].numel))
        self.stale = False

    # ------------------------------------------------------------- checkpoint
    def piece(self, index: int, key: torch.Tensor, state: MutableMapping[Any, Any]) -> tuple[torch.Tensor, StateSlot]:
        """Piece ``index``'s master and state slot, as memory maps of its files (writes go to disk)."""
        self.stale = True  # a load may write through them
        g, at = self.group_of[index]
        numel = self.layout.pieces[index].numel
        return self._mapped(g, "master", torch.float32).narrow(0, at, numel), NvmeSlot(self, index)

    def _mapped(self, g: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
        return self._files.mapped(f"g{g}.{kind}", self.groups[g].numel, dtype)

    def shard(self) -> torch.Tensor:
        """This rank's fp32 masters, whole (a copy: for full weights and a change of the trainable set)."""
        out = torch.zeros(self.layout.shard_numel, dtype=torch.float32)
        for group in self.groups:
            master = self._mapped(group.index, "master", torch.float32)
            for index, at in zip(group.pieces, group.offsets):
                piece = self.layout.pieces[index]
                out.narrow(0, piece.shard_offset, piece.numel).copy_(master.narrow(0, at, piece.numel))
        return out

    def nbytes(self) -> int:
        """Host bytes of the read-ahead/write-behind buffers (the masters themselves are on disk)."""
        return self.pool.nbytes()

    def export(self, state: MutableMapping[Any, Any], steps: dict[int, torch.Tensor], comm: Comm,
               gather: Gather) -> dict[int, Kept]:
        # A change of the trainable set gathers every parameter's state whole; it is read from disk for that.
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
    """One offloaded piece's optimizer state: per-element tensors map its sub-group's files."""

    def __init__(self, masters: OffloadedMasters, index: int) -> None:
        self.masters = masters
        self.index = index

    def _numel_at(self) -> tuple[int, int, int]:
        g, at = self.masters.group_of[self.index]
        return g, at, self.masters.layout.pieces[self.index].numel

    def get(self) -> dict[str, Any]:
        masters = self.masters
        g, at, numel = self._numel_at()
        out = dict(masters.small[self.index])
        for kind in sorted(masters.piece_kinds[self.index]):
            out[kind] = masters._mapped(g, kind, masters.kinds[g][kind]).narrow(0, at, numel)
        return out

    def set(self, state: dict[str, Any]) -> None:
        masters = self.masters
        g, at, numel = self._numel_at()
        masters.small[self.index] = {k: v for k, v in state.items() if not is_per_element(v, numel)}
        masters.piece_kinds[self.index] = set()
        for kind, value in state.items():
            if not is_per_element(value, numel):
                continue
            if kind not in masters.kinds[g]:
                masters.kinds[g][kind] = value.dtype
                masters._files.create(f"g{g}.{kind}", masters.groups[g].numel * value.element_size())
            masters._mapped(g, kind, masters.kinds[g][kind]).narrow(0, at, numel).copy_(value.reshape(-1))
            masters.piece_kinds[self.index].add(kind)


@contextlib.contextmanager
def _only(inner: Any, stepped: list[torch.Tensor]) -> Iterator[None]:
    """The inner optimizer's param groups hold only ``stepped`` (hyperparameters untouched), then all again."""
    wanted = {id(t) for t in stepped}
    saved = [group["params"] for group in inner.param_groups]
    for group in inner.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in wanted]
    try:
        yield
    finally:
        for group, params in zip(inner.param_groups, saved):
            group["params"] = params
