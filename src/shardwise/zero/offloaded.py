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
stepped: the loop stage 3 shares (:mod:`.offload_step`); what is this
arrangement's own is where a piece's gradient is and that updated values go
into the flat buffer.

Between steps the inner optimizer's ``state`` is empty and the tensors it
steps hold no memory (zero-stride placeholders); a checkpoint sees each
piece's master and state as memory maps of the files
(:class:`~.offload_step.OffloadSlot`), so saving, loading and resharding go
through the same :class:`~shardwise.param_state.ParamShard` as any other
arrangement.  With ``offload_optimizer.ratio`` below 1 the first sub-groups'
masters and state stay in host memory (:mod:`.offload_step`): a piece there
is a view of that memory instead of a map, and the files hold the rest.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, MutableMapping

import torch

from ..distributed import Comm
from ..param_state import StateSlot, copy_value
from .grads import ReducedGrads
from .layout import FlatLayout
from .masters_base import Gather, Masters
from .nvme_files import NvmeFiles
from .store.carry import export_state
from .store.frozen import Kept
from .store.plan import Chunk, OffloadSpec, plan_sub_groups, resident_split, say_split
from .store.subgroups import OffloadSlot, SubGroupStepper, placeholder, pool_for

__all__ = ["OffloadedMasters"]


class OffloadedMasters(Masters):
    """fp32 masters and optimizer state of this rank's shard in files under ``nvme_path``."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device, spec: OffloadSpec) -> None:
        super().__init__(layout, dtype, device)
        self.spec = spec
        #: the shard's first elements, whose master and state stay in host memory (``ratio`` below 1)
        self.resident = resident_split(layout.pieces, spec.sub_group_size, spec.ratio)
        chunks, self.groups = plan_sub_groups(layout.pieces, spec.sub_group_size, self.resident)
        say_split(spec, self.resident, layout.shard_numel, self.groups)
        #: the per-element state kinds there are files for
        self.kinds: dict[str, torch.dtype] = {}
        self.pool = pool_for(self.groups, spec.buffer_count, spec.state_bytes, spec.pin_memory and device.type == "cuda",
                             self.resident)
        self.stepper = SubGroupStepper(chunks, self.groups, self.pool, lambda: self._files, self.kinds,
                                       layout.shard_numel, self.resident)
        #: per piece, the tensor the param group holds (its ``.grad`` is the piece's gradient)
        self.keys: list[torch.Tensor] = []
        #: whether the files may hold masters the model's parameters do not show yet (a checkpoint borrowed them)
        self.stale = False
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
        """Claim the disk room the offloaded state needs, then write the initial fp32 masters."""
        layout, spec = self.layout, self.spec
        numel = layout.shard_numel - self.resident  # the elements the files hold
        files.reserve(numel * (4 + spec.state_bytes),
                      f"fp32 masters and {spec.state_bytes} bytes of optimizer state for each of {numel:,} elements")
        files.create("master", numel * 4)
        for piece in layout.pieces:
            param = layout.params[piece.param]
            source = initial.get(id(param), param.data).reshape(-1)[piece.start : piece.end]
            self.stepper.write("master", piece.shard_offset, source.float(), "the initial masters")

    @property
    def _files(self) -> NvmeFiles:
        if self.files is None:
            raise RuntimeError("the offloaded masters were closed (`engine.destroy()` ran); build a new engine")
        return self.files

    def _usable(self, doing: str) -> NvmeFiles:
        """The files, unless a failed step left them half-updated (stepping or saving them would spread that)."""
        self.stepper.check_whole(doing)
        return self._files

    def steps(self, grads: ReducedGrads) -> dict[int, torch.Tensor]:
        layout = self.layout
        views: dict[int, torch.Tensor] = {}
        for piece in layout.pieces:
            bucket, _ = layout.bucket_of[piece.param]
            key = placeholder(piece.numel)
            key.grad = grads.slices[bucket.index].narrow(0, piece.shard_offset - bucket.shard_offset, piece.numel)
            views.setdefault(id(layout.params[piece.param]), key)
        self.keys = [views[id(layout.params[p.param])] for p in layout.pieces]
        return views

    # ------------------------------------------------------------------- step
    def step(self, inner: Any) -> None:
        """One optimizer step over every sub-group: read ahead, step, publish, write behind (a step that
        fails part-way leaves the engine refusing to step or save: :meth:`.SubGroupStepper.step`)."""
        self.stepper.step(inner, self)
        self.stale = False  # the step read every piece's master from the files and published it

    def stepped(self, chunk: Chunk) -> torch.Tensor:
        """Every chunk is stepped (torch leaves one without a gradient alone), so every master is published."""
        return self.keys[chunk.piece]

    def publish_sub_group(self, updated: list[tuple[Chunk, torch.Tensor]]) -> None:
        """The updated masters into the model's flat parameter buffer."""
        for chunk, master in updated:
            self._owned(chunk.piece).narrow(0, chunk.at, chunk.numel).copy_(master)

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
        for index in range(len(self.layout.pieces)):
            self._owned(index).copy_(self._region(index, "master", torch.float32))
        self.stale = False

    # ------------------------------------------------------------- checkpoint
    def piece(self, index: int, key: torch.Tensor, state: MutableMapping[Any, Any]) -> tuple[torch.Tensor, StateSlot]:
        """Piece ``index``'s master and state slot, as memory maps of its files (writes go to disk)."""
        self._usable("save or load a checkpoint")
        self.stale = True  # a load writes through the map
        return self._region(index, "master", torch.float32), self._slot(index)

    def _slot(self, index: int) -> OffloadSlot:
        """Piece ``index``'s optimizer state, as memory maps of its files and its chunks' small values."""
        region = functools.partial(self._region, index)
        return OffloadSlot(self.stepper, index, self.layout.pieces[index].numel, region)

    def _region(self, index: int, kind: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Piece ``index``'s elements of ``kind``: a memory map of its file, or a view of host memory where the
        piece is resident (writes go there)."""
        piece = self.layout.pieces[index]
        return self.stepper.region(kind, piece.shard_offset, piece.numel, self.kinds[kind] if dtype is None else dtype)

    def shard(self) -> torch.Tensor:
        """This rank's fp32 masters, whole (a copy: for full weights and a change of the trainable set)."""
        return self.stepper.whole("master", torch.float32)

    def full(self, gather: Gather) -> dict[int, torch.Tensor]:
        if self.dtype != torch.float32:
            return super().full(gather)
        # fp32: the model's parameters hold the masters' exact values once published; no read, no gather
        self._refresh()
        layout = self.layout
        return {id(p): layout.param_slice(self.param_flat, i).view_as(p).clone() for i, p in enumerate(layout.params)}

    def nbytes(self) -> int:
        """Host bytes of the read-ahead/write-behind buffers and the resident masters (the others are on disk)."""
        return self.pool.nbytes() + self.stepper.memory_bytes(master=True)

    def state_nbytes(self) -> int:
        """Host bytes of the resident sub-groups' optimizer state (the inner optimizer holds none between steps)."""
        return self.stepper.memory_bytes(master=False)

    def export(self, state: MutableMapping[Any, Any], steps: dict[int, torch.Tensor], comm: Comm,
               gather: Gather) -> dict[int, Kept]:
        # A change of the trainable set gathers every parameter's state whole; it is read from disk for that.
        self._usable("change the trainable set")
        for index, key in enumerate(self.keys):
            entries = self._slot(index).get()
            if entries:
                state[key] = {k: copy_value(v) for k, v in entries.items()}
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
        """Delete this rank's offload folder and let the resident state go (``engine.destroy()``; also at exit)."""
        if self.files is not None:
            self.files.remove()
            self.files = None
        self.stepper.memory.clear()

    def release(self) -> None:
        super().release()
        self.close()
