"""The step of the store's home in files (:mod:`.nvme`): sub-group by sub-group, read ahead, step, write behind (at most
``count`` buffers alive).

A :class:`SubGroupStepper` holds what the inner optimizer keeps of each chunk between steps (its small state values,
which kinds of state are in the files) and runs the step: it reads a sub-group into a pool buffer (:class:`BufferPool`,
:func:`pipelined`), points the chunks' tensors, gradients and state at it, runs torch's ``step`` over those chunks only,
takes their state back out, hands the updated masters to the home (:class:`Arrangement`), and writes the buffer back
while the next sub-group steps.

A partial offload (``ratio`` below 1) keeps the shard's first ``resident`` elements, whole sub-groups, in host memory:
one tensor per kind, stepped in place with no I/O.  The files hold the elements after ``resident`` only (element ``x``
of the shard at ``x - resident`` of each file); :meth:`SubGroupStepper.region` and :meth:`SubGroupStepper.write` say
where a run lives, so checkpoints see one layout whichever side a piece is on.

The I/O (:func:`pipelined`): one background thread does every read and write in the order asked (a disk serves one
stream best, and order keeps a sub-group's write before any later read of it).  The caller steps sub-group ``i`` while
the thread writes ``i - 1`` and reads ``i + 1 ... i + count - 2``; host memory never holds more than ``count``
sub-groups.
"""

from __future__ import annotations

import bisect
import contextlib
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol, Sequence

import torch

from ...optim.param_state import copy_value, is_per_element
from ..offload.files import NvmeFiles, OffloadChecksumError, OffloadIOError
from .plan import Chunk, SubGroup

__all__ = [
    "Arrangement", "BufferPool", "OffloadSlot", "SubGroupStepper", "pipelined", "placeholder", "pool_for",
    "stepping_only",
]

#: byte alignment of each kind inside a sub-group's buffer (a typed view needs its element size at least)
_ALIGN = 64

#: per chunk of a sub-group: (kind, element of the shard it starts at, values) of state the step created
_Fresh = list[list[tuple[str, int, torch.Tensor]]]
#: a chunk a step loads: its index, the tensor its param group holds (``.grad``: the piece's gradient), that group
_Load = tuple[int, torch.Tensor, int]


#: fills a buffer with sub-group ``index``'s bytes
Read = Callable[[int, torch.Tensor], None]
#: steps sub-group ``index`` in its buffer and returns what writes it back
Step = Callable[[int, torch.Tensor], Callable[[], None]]


class BufferPool:
    """``count`` reusable byte buffers, each grown to the largest size asked of it."""

    def __init__(self, count: int, nbytes: int = 0, pin: bool = False) -> None:
        self.count, self.pin = count, pin
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        # Sized up front for the state expected: growing them later would leave the old ones to the
        # allocator, which keeps freed heap memory resident (see docs/offload.md).
        for _ in range(count):
            self._free.put(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin))

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` (waits for one to come back from a write)."""
        buffer = self._free.get()
        if buffer.numel() < nbytes:
            try:
                buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            except BaseException:
                self._free.put(buffer)  # out of memory: the pool keeps its count, or a later take waits forever
                raise
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        self._free.put(buffer)

    def nbytes(self) -> int:
        """Bytes the free buffers hold (all of them, between steps)."""
        held = [self._free.get() for _ in range(self.count)]
        for buffer in held:
            self._free.put(buffer)
        return sum(b.numel() for b in held)


def pipelined(order: Sequence[int], sizes: Sequence[int], pool: BufferPool, read: Read, step: Step,
              meanwhile: Callable[[], None] = lambda: None) -> None:
    """Run ``step`` over the sub-groups in ``order``, each read ahead into a pool buffer and written behind;
    ``meanwhile`` runs once the first reads are started, before the first step (work that needs no buffer:
    a partial offload's sub-groups in memory, stepped while the disk reads).

    Returns once every write is on disk.  The first error of a read, a step or a write is raised here, as
    soon as the loop sees it (a failed write is not followed by stepping every later sub-group first), and
    every buffer is back in ``pool`` by then, so the next call does not wait for one that never returns.
    """
    ahead = max(1, pool.count - 1)  # one buffer is the one being stepped
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-offload-io") as io:
        reads: dict[int, tuple[Future[None], torch.Tensor]] = {}
        writes: list[Future[None]] = []

        def start_read(position: int) -> None:
            index = order[position]
            buffer = pool.take(sizes[index])
            reads[position] = (_submit(io, pool, buffer, read, index, buffer), buffer)

        try:
            for position in range(min(ahead, len(order))):
                start_read(position)
            meanwhile()
            for position, index in enumerate(order):
                future, buffer = reads.pop(position)
                try:
                    future.result()
                    write = step(index, buffer)
                except BaseException:
                    pool.give(buffer)
                    raise
                writes = _unfinished([*writes, _submit(io, pool, buffer, _then_give, write, pool, buffer)])
                if position + ahead < len(order):
                    start_read(position + ahead)
        finally:
            # On an error too: every read in flight ends and gives its buffer back, so the next step (or
            # `memory_breakdown`) never waits on a buffer that will not come back.
            for future, buffer in reads.values():
                try:
                    future.result()
                except BaseException:  # noqa: BLE001 - the first error is the one raised
                    pass
                pool.give(buffer)
        for done in writes:
            done.result()


def _submit(io: ThreadPoolExecutor, pool: BufferPool, buffer: torch.Tensor, call: Callable[..., None],
            *args: Any) -> Future[None]:
    """``io.submit(call, *args)``, giving ``buffer`` back if it cannot be queued (an interrupt, shutdown at exit)."""
    try:
        return io.submit(call, *args)
    except BaseException:
        pool.give(buffer)
        raise


def _unfinished(writes: list[Future[None]]) -> list[Future[None]]:
    """The writes still to finish; raises the error of the first that failed (its buffer went back already).  Finished
    ones are dropped, so each check looks at no more than the pool's buffers."""
    pending = []
    for write in writes:
        if not write.done():
            pending.append(write)
        elif write.exception() is not None:  # judged once: a write ending meanwhile is kept, not lost
            raise write.exception()  # type: ignore[misc]
    return pending


def _then_give(write: Callable[[], None], pool: BufferPool, buffer: torch.Tensor) -> None:
    try:
        write()
    finally:
        pool.give(buffer)



def placeholder(numel: int) -> torch.Tensor:
    """A tensor of ``numel`` elements that holds one: what the optimizer holds for a chunk between steps."""
    return torch.zeros(1).expand(numel)


def pool_for(groups: list[SubGroup], count: int, state_bytes: int, pin: bool = False, resident: int = 0) -> BufferPool:
    """``count`` buffers (no more than there are offloaded sub-groups: more would never be in use at once) sized
    for the largest offloaded sub-group's master and ``state_bytes`` of state per element (those in the shard's
    first ``resident`` elements are stepped in memory: no buffer if all are)."""
    offloaded = [g.numel for g in groups if g.end > resident]
    if not offloaded or max(offloaded) == 0:
        return BufferPool(0)
    return BufferPool(min(count, len(offloaded)), max(offloaded) * (4 + state_bytes) + _ALIGN * 4, pin=pin)


class Arrangement(Protocol):
    """What the home in files tells the step about its pieces."""

    def stepped(self, chunk: Chunk) -> Optional[torch.Tensor]:
        """The tensor the inner optimizer's param group holds for the chunk's piece (its ``.grad`` the piece's
        gradient, None where torch leaves it alone), or None where this step passes the chunk by."""
        ...

    def publish_sub_group(self, updated: list[tuple[Chunk, torch.Tensor]]) -> None:
        """One sub-group's updated fp32 masters (views of its buffer, valid until its write) to the model."""
        ...


class SubGroupStepper:
    """The chunks and sub-groups of a rank's files, what the optimizer keeps of each chunk, and the step."""

    def __init__(self, chunks: list[Chunk], groups: list[SubGroup], pool: BufferPool,
                 files: Callable[[], NvmeFiles], kinds: dict[str, torch.dtype], numel: int, resident: int = 0) -> None:
        """``files`` gives the open files (or raises once they are closed); ``kinds`` (the caller's, added to
        here) maps each kind there is a file for to its dtype; the shard has ``numel`` elements, of which the
        first ``resident`` (whole sub-groups) stay in host memory and the files hold the others."""
        self.chunks, self.groups, self.pool = chunks, groups, pool
        self._starts = [g.start for g in groups]
        self.files, self.kinds, self.numel, self.resident = files, kinds, numel, resident
        if any(g.start < resident < g.end for g in groups):
            raise RuntimeError(f"a sub-group spans the resident split at element {resident:,} (a bug in shardwise); "
                               "please report it")
        #: per kind, the resident elements' values (host memory; the master's made here, the others with their file)
        self.memory: dict[str, torch.Tensor] = {"master": torch.zeros(resident)}
        #: per piece (by index), its chunks
        self.chunks_of: dict[int, list[int]] = {}
        for index, chunk in enumerate(chunks):
            self.chunks_of.setdefault(chunk.piece, []).append(index)
        #: per chunk: the kinds it has state in, its other (small) state values, the tensor the optimizer steps
        self.chunk_kinds: list[set[str]] = [set() for _ in chunks]
        self.small: list[dict[str, Any]] = [{} for _ in chunks]
        self.keys = [placeholder(chunk.numel) for chunk in chunks]
        #: why the files no longer hold one step's state (a step failed part-way); None while they do
        self.broken: Optional[str] = None

    def check_whole(self, doing: str) -> None:
        """Raise unless the files hold one step's state: after a step failed part-way, stepping, saving or
        changing the trainable set would spread a state that is half the new step and half the old."""
        if self.broken is not None:
            raise RuntimeError(
                f"rank {self.files().rank}: cannot {doing}: this engine's offloaded optimizer state {self.broken}. "
                "Build a new engine and `load_checkpoint` the last checkpoint")

    def step(self, inner: Any, arrangement: Arrangement) -> None:
        """One optimizer step over every sub-group with a chunk to step: read ahead, step, publish, write behind.  A
        step that fails part-way leaves the engine refusing to step, save or change its trainable set
        (:meth:`check_whole`): no roll-back, as the files would need a second copy of the state."""
        self.check_whole("step")
        try:
            self._step(inner, arrangement)
        except OffloadIOError as exc:
            if isinstance(exc, OffloadChecksumError):
                self.broken = f"was read back changed from what this rank wrote ({exc.path} failed its checksum)"
            else:
                self._part_way(f"{exc.operation} {exc.path} failed")
            if self.files().failed is not None:
                raise  # the files lost the state: their error says the engine refuses to go on
            raise exc.extended("This step updated part of the offloaded state only: this engine now refuses to "
                               "step or save; restart from the last checkpoint (a new engine and "
                               "`load_checkpoint`)") from exc.__cause__
        except BaseException as exc:
            self._part_way(f"{type(exc).__name__}: {exc}")
            raise

    def _part_way(self, why: str) -> None:
        self.broken = (f"is incomplete since a step failed part-way ({why}); some sub-groups hold the new step and "
                       "some the old")

    def _step(self, inner: Any, arrangement: Arrangement) -> None:
        kinds = dict(self.kinds)  # what the reads of this step find on disk (the step may add kinds)
        sizes = [_regions(g.numel, kinds)[-1][2] for g in self.groups]
        loads = self._loads(inner, arrangement)
        resident = [g.index for g in self.groups if loads[g.index] and self.is_resident(g.index)]

        def step_resident() -> None:  # while the first offloaded sub-groups are read; stepped in place in host memory
            for g in resident:
                at, numel = self.groups[g].start, self.groups[g].numel
                views = {kind: self.memory[kind].narrow(0, at, numel) for kind in ("master", *sorted(kinds))}
                self._step_group(inner, arrangement, g, loads[g], views)()

        # a sub-group with nothing to step: no I/O
        order = [g.index for g in self.groups if loads[g.index] and not self.is_resident(g.index)]
        pipelined(order, sizes, self.pool, lambda g, buffer: self._read(g, buffer, kinds),
                  lambda g, buffer: self._step_group(inner, arrangement, g, loads[g],
                                                     _views(self.groups[g].numel, buffer, kinds)),
                  step_resident)

    def _loads(self, inner: Any, arrangement: Arrangement) -> list[list[_Load]]:
        """Per sub-group, the chunks this step loads, each with the tensor its param group holds and that group."""
        owner = {id(p): i for i, group in enumerate(inner.param_groups) for p in group["params"]}
        loads = []
        for group in self.groups:
            held = [(index, arrangement.stepped(self.chunks[index])) for index in group.chunks]
            loads.append([(index, tensor, owner[id(tensor)]) for index, tensor in held if tensor is not None])
        return loads

    def is_resident(self, g: int) -> bool:
        """Whether sub-group ``g`` stays in host memory (a partial offload)."""
        return self.groups[g].end <= self.resident

    def _where(self, g: int) -> str:
        """Sub-group ``g`` in words, for an I/O error."""
        group = self.groups[g]
        return (f"sub-group {g + 1} of {len(self.groups)}: elements {group.start:,}-{group.end:,} "
                "of this rank's shard")

    def _read(self, g: int, buffer: torch.Tensor, kinds: Mapping[str, torch.dtype]) -> None:
        group, files, where = self.groups[g], self.files(), self._where(g)
        for kind, view in _views(group.numel, buffer, kinds).items():
            files.read_into(kind, view, (group.start - self.resident) * view.element_size(), where)

    def _step_group(self, inner: Any, arrangement: Arrangement, g: int, loads: list[_Load],
                    views: dict[str, torch.Tensor]) -> Callable[[], None]:
        """Step sub-group ``g``'s chunks in ``loads`` in its buffer; returns what writes the buffer back."""
        start = self.groups[g].start
        params: list[list[torch.Tensor]] = [[] for _ in inner.param_groups]
        for index, tensor, param_group in loads:
            params[param_group].append(self._load(inner, index, tensor.grad, views, start))
        with stepping_only(inner, params):
            inner.step()
        updated = [(self.chunks[index], self.keys[index].detach()) for index, _, _ in loads]
        fresh = [self._take_state(inner, index, views, start) for index, _, _ in loads]
        arrangement.publish_sub_group(updated)
        for kind, _, value in (item for items in fresh for item in items):  # files for kinds the step created
            self.kind_file(kind, value.dtype)
        return lambda: self._write(g, views, fresh)

    def _load(self, inner: Any, index: int, grad: Optional[torch.Tensor], views: dict[str, torch.Tensor],
              start: int) -> torch.Tensor:
        """Point chunk ``index``'s tensor, gradient (of its piece: None to be left alone) and state at the buffer."""
        chunk, key = self.chunks[index], self.keys[index]
        at = chunk.shard_at - start
        key.data = views["master"].narrow(0, at, chunk.numel)
        key.grad = None if grad is None else grad.narrow(0, chunk.at, chunk.numel)
        entries = dict(self.small[index])
        entries.update({kind: views[kind].narrow(0, at, chunk.numel) for kind in self.chunk_kinds[index]})
        if entries:
            inner.state[key] = entries  # torch keys state by the tensor it steps
        return key

    def _take_state(self, inner: Any, index: int, views: dict[str, torch.Tensor],
                    start: int) -> list[tuple[str, int, torch.Tensor]]:
        """Take chunk ``index``'s state out of the optimizer and let its tensor go.  Returns the per-element tensors
        that are not in the buffer already (created by this step)."""
        chunk, key = self.chunks[index], self.keys[index]
        at = chunk.shard_at - start
        entries = inner.state.pop(key, {})
        self.small[index] = {}
        fresh = []
        for kind, value in entries.items():
            if not is_per_element(value, chunk.numel):
                self.small[index][kind] = value
                continue
            self.chunk_kinds[index].add(kind)
            where = views.get(kind)
            if where is None or where.narrow(0, at, chunk.numel).data_ptr() != value.data_ptr():
                fresh.append((kind, chunk.shard_at, value.detach().reshape(-1)))
        key.data, key.grad = placeholder(chunk.numel), None
        return fresh

    def kind_file(self, kind: str, dtype: torch.dtype) -> None:
        """A file (offloaded elements) and a tensor (resident ones) for state ``kind``, unless there are."""
        if kind not in self.kinds:
            self.files().create(kind, (self.numel - self.resident) * dtype.itemsize)
            self.memory[kind] = torch.zeros(self.resident, dtype=dtype)
            self.kinds[kind] = dtype

    def _write(self, g: int, views: dict[str, torch.Tensor], fresh: _Fresh) -> None:
        """On the I/O thread: sub-group ``g``'s buffer back to its files (a resident sub-group was stepped in
        place), then the state this step created, wherever its elements live."""
        where = self._where(g)
        if not self.is_resident(g):
            files, start = self.files(), self.groups[g].start - self.resident
            for kind, view in views.items():
                files.write_from(kind, view, start * view.element_size(), where)
        for items in fresh:
            for kind, shard_at, value in items:
                self.write(kind, shard_at, value, where)

    def region(self, kind: str, start: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the shard's ``kind`` (on one side of the resident split): a view
        of host memory, or a memory map of the file; writes go there either way."""
        files = self.files()  # (raises once they are closed, the resident state gone with them)
        if start + numel <= self.resident:
            return self.memory[kind].narrow(0, start, numel)
        self._one_side(start, numel)

        def where(byte: int) -> str:  # a byte of the file, in the shard's sub-groups
            return self._where(max(0, bisect.bisect_right(self._starts, self.resident + byte // dtype.itemsize) - 1))

        return files.mapped_range(kind, start - self.resident, numel, dtype, where)

    def write(self, kind: str, start: int, values: torch.Tensor, where: str = "") -> None:
        """``values`` (1-D, CPU) into elements ``[start, ...)`` of the shard's ``kind``."""
        files = self.files()
        if start + values.numel() <= self.resident:
            self.memory[kind].narrow(0, start, values.numel()).copy_(values)
            return
        self._one_side(start, values.numel())
        files.write_from(kind, values, (start - self.resident) * values.element_size(), where)

    def whole(self, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """The shard's ``kind``, all of it (a copy: the resident elements, then the file's)."""
        offloaded, files = self.numel - self.resident, self.files()
        whole = torch.empty(self.numel, dtype=dtype)
        whole[: self.resident].copy_(self.memory[kind])
        if offloaded:  # read (and checked), not mapped: nothing writes through it
            files.read_into(kind, whole[self.resident :], 0, f"all of this rank's `{kind}`")
        return whole

    def memory_bytes(self, master: bool) -> int:
        """Host bytes of the resident elements' master (``master``) or optimizer state (not ``master``)."""
        return sum(t.numel() * t.element_size() for k, t in self.memory.items() if (k == "master") == master)

    def _one_side(self, start: int, numel: int) -> None:
        if start < self.resident:
            raise RuntimeError(f"elements {start:,}-{start + numel:,} span the resident split at {self.resident:,} "
                               "(a bug in shardwise); please report it")

    def forget(self, piece: int) -> None:
        """Piece ``piece`` has no optimizer state any more."""
        for chunk in self.chunks_of.get(piece, []):
            self.chunk_kinds[chunk], self.small[chunk] = set(), {}


class OffloadSlot:
    """One offloaded piece's optimizer state: per-element tensors map its files, the rest is its first chunk's."""

    def __init__(self, stepper: SubGroupStepper, piece: int, numel: int, region: Callable[[str], torch.Tensor]) -> None:
        """``region(kind)``: the piece's ``numel`` elements of file ``kind`` as a memory map."""
        self.stepper, self.chunks, self.numel, self.region = stepper, stepper.chunks_of.get(piece, []), numel, region

    def get(self) -> dict[str, Any]:
        stepper = self.stepper
        out = dict(stepper.small[self.chunks[0]])
        for kind in sorted(set.intersection(*(stepper.chunk_kinds[c] for c in self.chunks))):
            out[kind] = self.region(kind)
        return out

    def set(self, state: dict[str, Any]) -> None:
        stepper = self.stepper
        per_element = {k: v for k, v in state.items() if is_per_element(v, self.numel)}
        for chunk in self.chunks:  # each chunk is stepped as its own tensor: its own copy of `step` and the like
            # (on the host, where the step runs: a state loaded from an accelerator job's checkpoint may not be)
            stepper.small[chunk] = {k: copy_value(v.cpu() if isinstance(v, torch.Tensor) else v)
                                    for k, v in state.items() if k not in per_element}
            stepper.chunk_kinds[chunk] = set(per_element)
        for kind, value in per_element.items():
            stepper.kind_file(kind, value.dtype)
            self.region(kind).copy_(value.reshape(-1))


def _regions(numel: int, kinds: Mapping[str, torch.dtype]) -> list[tuple[str, torch.dtype, int]]:
    """(kind, dtype, end byte) of each kind in a sub-group's buffer, the master first, each region aligned."""
    end, out = 0, []
    for kind, dtype in [("master", torch.float32), *sorted(kinds.items())]:
        end = -(-end // _ALIGN) * _ALIGN + numel * dtype.itemsize
        out.append((kind, dtype, end))
    return out


def _views(numel: int, buffer: torch.Tensor, kinds: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """Each kind's typed view of its region of a sub-group's buffer."""
    views = {}
    for kind, dtype, end in _regions(numel, kinds):
        size = numel * dtype.itemsize
        views[kind] = buffer.narrow(0, end - size, size).view(dtype)
    return views


@contextlib.contextmanager
def stepping_only(inner: Any, stepped: list[list[torch.Tensor]]) -> Iterator[None]:
    """Param group ``i`` holds only ``stepped[i]`` (hyperparameters untouched), then all its tensors again."""
    saved = [group["params"] for group in inner.param_groups]
    for group, tensors in zip(inner.param_groups, stepped):
        group["params"] = tensors
    try:
        yield
    finally:
        for group, params in zip(inner.param_groups, saved):
            group["params"] = params
