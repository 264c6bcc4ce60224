"""The store's home in files (``offload_optimizer: {device: nvme}``): fp32 masters and optimizer state on disk.

Each piece gets a run of elements at ``piece.at`` in a ``master`` file and one file per kind of per-element state
(``exp_avg``, ...), laid out as this rank's shard, in a folder of this rank's own (:class:`~..offload.files.NvmeFiles`);
with ``ratio`` below 1 the first sub-groups stay in host memory (:mod:`.subgroups`).  The tensor the inner optimizer
holds for a piece (its key) is a one-element placeholder whose ``.grad`` is the piece's fp32 gradient, in memory as
without offload, so clipping and the unused-parameter rule see it unchanged.

The step (:class:`~.subgroups.SubGroupStepper`) reads each sub-group ahead on a background thread, runs torch's ``step``
over it, publishes its masters through the stage's :class:`~.store.ModelSide` and writes it back while the next one
steps; a sub-group whose chunks have no gradient is neither read nor written.  Between steps the inner optimizer's
``state`` is empty.  A checkpoint sees a piece's master and state as memory maps of the files
(:class:`~.subgroups.OffloadSlot`); a piece that stops training takes them out into the store's kept entries. On a job
on an accelerator gradients come down and masters go up through :class:`~.copies.DeviceCopies`.
"""

from __future__ import annotations

import contextlib
from typing import Any, MutableMapping, Optional, Sequence

import torch

from ...optim.param_state import KeptSlot, copy_value
from ..offload.files import NvmeFiles
from .copies import DeviceCopies
from .host import fused_on_host
from .plan import Chunk, OffloadSpec, plan_sub_groups, resident_split, say_split, state_bytes_per_element
from .store import Home, Kept, ModelSide, Piece, Run, planned_index
from .subgroups import BufferPool, OffloadSlot, SubGroupStepper, placeholder, pool_for

__all__ = ["Nvme"]


class Nvme(Home):
    """fp32 masters and optimizer state of this rank's pieces in files under ``nvme_path`` (module docstring)."""

    def __init__(self, side: ModelSide, spec: OffloadSpec, pin: bool = False,
                 copies: Optional[DeviceCopies] = None) -> None:
        super().__init__(side, copies)
        self.spec, self.pin = spec, pin
        #: the per-element state kinds there are files for, and their dtype
        self.kinds: dict[str, torch.dtype] = {}
        self.files: Optional[NvmeFiles] = None
        self.pool = BufferPool(0)
        self._stepper: Optional[SubGroupStepper] = None
        #: the runs of the shard the pieces fill, in order (the plan's)
        self._runs: list[Run] = []
        #: each piece's index in the plan
        self._index: dict[Piece, int] = {}
        #: whether the files may hold masters the model does not show yet (a checkpoint load or adoption wrote them)
        self.stale = False

    def plan(self, runs: Sequence[Run], numel: int, inner: Any) -> None:
        """Plan the sub-groups of ``runs``, then make this rank's folder and its ``master`` file for the offloaded
        ones of the shard's ``numel`` elements, once there is room."""
        if inner is None:
            return  # inference: no optimizer, no masters
        state_bytes = state_bytes_per_element(inner)
        self._runs = list(runs)
        resident = resident_split(self._runs, self.spec.sub_group_size, self.spec.ratio)
        chunks, groups = plan_sub_groups(self._runs, self.spec.sub_group_size, resident)
        say_split(self.spec, resident, numel, groups)
        self.pool = pool_for(groups, self.spec.buffer_count, state_bytes, self.pin, resident)
        self._stepper = SubGroupStepper(chunks, groups, self.pool, lambda: self._files, self.kinds, numel, resident)
        if self.copies is not None:
            self.copies.plan(0, numel)
        offloaded = numel - resident
        files = NvmeFiles(self.spec.root, self.spec.rank)
        try:  # the room every rank of this host on the disk claims, not this rank's alone
            files.reserve(offloaded * (4 + state_bytes), f"fp32 masters and {state_bytes} bytes of "
                          f"optimizer state for each of {offloaded:,} elements")
            files.create("master", offloaded * 4)
        except BaseException:  # refused or failed at initialize: no folder is left behind
            files.remove()
            raise
        self.files = files

    def add(self, piece: Piece, initial: Optional[torch.Tensor]) -> None:
        if piece.at < 0:
            return  # a frozen flat-stage parameter, kept whole by the store
        self._index[piece] = planned_index(piece, self._runs, len(self._index), self.spec.rank, "files")
        super().add(piece, initial)

    def start(self, piece: Piece, initial: torch.Tensor) -> torch.Tensor:
        # the files take host bytes: on an accelerator job ``initial`` is the model's own (device) tensor
        self.stepper.write("master", piece.at, initial.to("cpu", torch.float32).contiguous(), "the initial masters")
        return placeholder(piece.numel)

    @property
    def _files(self) -> NvmeFiles:
        if self.files is None:
            raise RuntimeError(f"rank {self.spec.rank}: the offloaded masters were closed (`engine.destroy()` ran); "
                               "build a new engine")
        return self.files

    @property
    def stepper(self) -> SubGroupStepper:
        """The sub-groups of the shard and the step over them (planned in :meth:`plan`)."""
        if self._stepper is None:
            raise RuntimeError(f"rank {self.spec.rank}: the offloaded masters were used before they were planned "
                               "(a bug in shardwise); please report it")
        return self._stepper

    @property
    def resident(self) -> int:
        """Elements of the shard whose master and state stay in host memory (``ratio`` below 1)."""
        return self._stepper.resident if self._stepper is not None else 0

    def check_whole(self, doing: str) -> None:
        if self._stepper is not None:
            self._stepper.check_whole(doing)

    def region(self, kind: str, piece: Piece) -> torch.Tensor:
        """The piece's elements of ``kind``: a memory map of its file, or a view of host memory (writes go there)."""
        return self.stepper.region(kind, piece.at, piece.numel, self.kinds.get(kind, torch.float32))

    def master(self, piece: Piece) -> torch.Tensor:
        return self.region("master", piece)

    def slot(self, piece: Piece, state: MutableMapping[Any, Any]) -> OffloadSlot:
        return OffloadSlot(self.stepper, self._index[piece], piece.numel, lambda kind: self.region(kind, piece))

    def freeze(self, piece: Piece, state: MutableMapping[Any, Any]) -> Kept:
        kept_state = {k: copy_value(v) for k, v in self.slot(piece, state).get().items()}
        kept = Kept(piece.start, piece.end, self.region("master", piece).clone(), KeptSlot(kept_state))
        self.stepper.forget(self._index[piece])
        return kept

    def thaw(self, piece: Piece, kept: Optional[Kept], state: MutableMapping[Any, Any]) -> None:
        self.region("master", piece).copy_(kept.master if kept is not None else self.side.values(piece))
        self.stepper.forget(self._index[piece])
        if kept is not None and kept.state:
            self.slot(piece, state).set(kept.state)
        piece.key = placeholder(piece.numel)

    def step(self, inner: Any) -> None:
        self.publish()  # after a load: the files' masters into the model first
        self.side.settle()  # (a shard a failed step left held)
        self.settle_grads()
        # on an accelerator the reference steps on the device, so nothing is lost by taking the host's fastest kernel
        # (a CPU job keeps the model's own, as its run without offload does: the same values to the bit)
        with fused_on_host(inner) if self.copies is not None else contextlib.nullcontext():
            self.stepper.step(inner, self)
        self.side.settle()

    def stepped(self, chunk: Chunk) -> Optional[torch.Tensor]:
        """The chunk's key where its piece trains and has a gradient this step (else the step passes it by)."""
        key = self.pieces[chunk.piece].key
        return key if key is not None and key.grad is not None else None

    def publish_sub_group(self, updated: list[tuple[Chunk, torch.Tensor]]) -> None:
        self._write([(self.pieces[chunk.piece], chunk.at, master) for chunk, master in updated])

    def _write(self, runs: list[tuple[Piece, int, torch.Tensor]]) -> None:
        """Into the model (through the copies up where it is on an accelerator)."""
        if self.copies is not None:
            self.copies.publish(self.side.write, runs)
        else:
            self.side.write(runs)

    def publish(self) -> None:
        """The step publishes each sub-group's masters as it goes; after a load, all of them."""
        if not self.stale:
            return
        self._write([(p, 0, self.region("master", p)) for p in self.pieces if p.key is not None])
        self.side.settle()
        self.stale = False

    def loading(self) -> None:
        self.stale = True  # the loaded masters reach the model at the next publish

    def nbytes(self) -> int:
        """Host bytes of the I/O buffers, the resident masters and the copies' gradient and staging buffers."""
        resident = self._stepper.memory_bytes(master=True) if self._stepper is not None else 0
        return self.pool.nbytes() + resident + (self.copies.nbytes() if self.copies is not None else 0)

    def state_nbytes(self) -> int:
        return self._stepper.memory_bytes(master=False) if self._stepper is not None else 0

    def close(self) -> None:
        """Delete this rank's offload folder and let the resident state go (``engine.destroy()``; also at exit)."""
        if self.files is not None:
            self.files.remove()
            self.files = None
        if self._stepper is not None:
            self._stepper.memory.clear()
