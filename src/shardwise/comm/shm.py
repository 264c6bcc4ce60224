"""Collectives through shared memory, for the CPU ranks of one host.

gloo moves every byte through a loopback TCP socket (two copies and the kernel's network stack, on the cores
training needs); ranks on one host can read each other's data where it lies.  Measured on a 2-core Xeon, 2
ranks, a 20 MB fp32 all-reduce: gloo 12-19 ms, this module 6-8 ms, bit-identical (docs/benchmarks.md).

How.  The ranks map one segment under ``/dev/shm``: per-rank flags and, per rank, two slots of :data:`CHUNK` bytes.
A collective runs chunk by chunk, chunk ``s`` in slot ``s % 2``: a rank copies its part in, publishes ``s + 1`` in
its flag, waits until every flag reads at least ``s + 1``, then reads every slot (a sum in rank order, the same bits
on every rank, or an all-gather's pieces).  Two slots suffice: a rank writes slot ``s % 2`` again only at ``s + 2``,
after every flag reached ``s + 1``, which a rank publishes only once it read chunk ``s``.  Collectives run in issue
order on one worker thread per segment, so an asynchronous one overlaps backward as gloo's does.  A rank polls its
peers' flags with a growing sleep (20 µs up to 0.5 ms, 5 ms after a second) and gives up after ``comms.timeout`` or
once a peer's heartbeat stops, with a ``RuntimeError`` the fault layer names.  Buffers every rank maps
(:meth:`SharedSegment.allocate`) need no staging: each rank sums its 1/N of the region across the N copies, fenced
by two flags ("written", "done reading"), a fifth of the staged path's bytes at 2 ranks.

Set up once per :class:`~shardwise.comm.distributed.Comm` that asks (its :class:`SharedMemory` handle), as
docs/faults.md ("comms") describes: used only if every rank mapped the file, whose name every rank removes on every way
out (:func:`sweep` takes a dead creator's).  x86-64 only: there stores become visible to other cores in program order,
so a peer that reads a flag also sees the data written before.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import platform
import queue
import re
import secrets
import struct
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..faults.liveness import PeerWatch
from .processes import running

__all__ = ["CHUNK", "KINDS", "Job", "SharedMemory", "ShmWork", "SharedSegment", "open_segment", "supported", "sweep"]

#: bytes per rank per step (measured: 4 MiB beat 1, 2, 8 and 16 MiB for a 20 MB all-reduce)
CHUNK = 4 << 20
_HEADER = 4096  # bytes: int64 words, [0] the token, [8 + r] rank r's flag
_TOKEN, _FLAGS = 0, 8
_MAX_RANKS = _HEADER // 8 - _FLAGS
_DIRECTORY = "/dev/shm"
#: a segment file's name: the prefix, the creating process's id, a random part
_PREFIX = "shardwise-"
_NAME = re.compile(rf"{_PREFIX}(\d+)-[0-9a-f]{{16}}")
_FIRST_SLEEP, _LAST_SLEEP = 2e-5, 5e-4  # seconds between polls of a flag, doubling up to the last
#: after this long waiting (a peer busy elsewhere: evaluation, data loading) poll this often instead
_LONG_WAIT, _LONG_SLEEP = 1.0, 5e-3


def supported(world: int) -> str:
    """Why this process cannot use shared memory for a ``world``-rank group ('' when it can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU is {platform.machine()}, not x86-64"
    if world > _MAX_RANKS:
        return f"{world} ranks is more than {_MAX_RANKS}"
    if not os.path.isdir(_DIRECTORY):
        return f"there is no {_DIRECTORY}"
    return ""


@dataclasses.dataclass(eq=False)
class ShmWork:
    """An issued shared-memory collective (``Comm`` puts it on :attr:`SharedSegment.jobs`): ``done`` is set once the
    worker finished it, with ``error`` what it raised.  Only ``Comm`` waits for one, for ``done`` in slices
    (``comm.distributed._finished``; shared memory serves gloo groups only, whose waits all go that way)."""

    #: the segment's worker thread, which finishes it (its end before then is an error)
    worker: threading.Thread
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: Optional[BaseException] = None


class SharedSegment:
    """A mapped segment and the worker thread that runs one group's collectives through it."""

    def __init__(self, mapped: mmap.mmap, rank: int, world: int, peers: list[int], timeout: float) -> None:
        self.rank, self.world = rank, world
        self._words = memoryview(mapped)[:_HEADER].cast("q")
        data = torch.frombuffer(mapped, dtype=torch.uint8, offset=_HEADER, count=2 * world * CHUNK)
        self._slots = data.view(2, world, CHUNK)
        self._seq = 0
        self._peers = [p for i, p in enumerate(peers) if i != rank]  # global ranks, for the heartbeat watch
        self._timeout = timeout
        self._watch = PeerWatch()
        self._broken: Optional[BaseException] = None
        #: the waiter gave up (a peer raised and will not come): the collective being run stops waiting
        self._abandoned = False
        #: buffers every rank maps: this rank's base address -> (bytes, every rank's copy as uint8, None for this rank)
        self._shared: dict[int, tuple[int, list[Optional[torch.Tensor]]]] = {}
        #: the collectives to run, in the order issued: ``(segment, kind, tensors, work)`` (:data:`Job`); ``Comm``
        #: puts its own here directly (no call on the issuing thread but the queue's)
        self.jobs: queue.SimpleQueue[Optional[Job]] = queue.SimpleQueue()
        # The thread holds the segment only weakly: a segment nobody uses any more is freed, and its thread ends.
        self.worker = threading.Thread(target=_serve, args=(self.jobs, weakref.ref(self)), name="shardwise-shm",
                                       daemon=True)
        self.worker.start()

    def close(self) -> None:
        """End the worker thread once the collectives already issued are done."""
        self.jobs.put(None)

    def abandon(self) -> None:
        """The group is broken (its waiter raised): the collective waiting for a peer stops at its next poll,
        and every later one fails at once, instead of each waiting out ``comms.timeout``."""
        self._abandoned = True

    def _run(self, job: "Job") -> None:
        """On the worker: run one collective (over a buffer every rank maps, reading the peers' copies in place,
        where its tensor lies in one), and finish its work."""
        _, kind, tensors, work = job
        if self._broken is None:
            try:
                if kind == "all_gather":
                    self._all_gather(*tensors)
                elif kind == "all_reduce":
                    copies = self._copies(tensors[0])
                    self._all_reduce(*tensors) if copies is None else self._all_reduce_shared(tensors[0], copies)
                else:
                    output, input = tensors
                    copies = self._copies(input)
                    self._reduce_scatter(output, input) if copies is None else self._reduce_scatter_shared(output,
                                                                                                          copies)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter; later collectives fail too
                self._broken = RuntimeError(str(exc))
                self._broken.__cause__ = exc
        work.error = self._broken
        work.done.set()

    # ----------------------------------------------------------- one step
    def _mine(self) -> torch.Tensor:
        """This rank's slot for the next step (write its part there, then :meth:`_publish`)."""
        return self._slots[self._seq % 2, self.rank]

    def _publish(self) -> torch.Tensor:
        """Say this rank's slot is written; return every rank's slot of this step once all are."""
        seq = self._seq
        self._seq += 1
        self._words[_FLAGS + self.rank] = seq + 1
        self._await(seq + 1)
        return self._slots[seq % 2]

    def _await(self, value: int) -> None:
        words = self._words
        start = time.monotonic()
        for r in range(self.world):
            delay = _FIRST_SLEEP
            while words[_FLAGS + r] < value:
                time.sleep(delay)
                if delay < _LAST_SLEEP:
                    delay *= 2
                    continue
                self._check_peers(r, start)
                if time.monotonic() - start > _LONG_WAIT:
                    delay = _LONG_SLEEP  # a long wait costs the waiting rank's core ~200 wake-ups a second

    def _check_peers(self, waiting_for: int, start: float) -> None:
        if self._abandoned:
            raise RuntimeError(f"shared-memory collective abandoned while waiting for group rank {waiting_for}: "
                               "this rank gave up on the group (its error says why)")
        gone = self._watch.gone(self._peers)
        if gone:
            raise RuntimeError(f"shared-memory collective: rank(s) {gone} stopped beating (gone) while this rank "
                               f"waited for group rank {waiting_for}")
        if time.monotonic() - start > self._timeout:
            raise RuntimeError(f"shared-memory collective timed out after {self._timeout:g} s waiting for group "
                               f"rank {waiting_for}")

    # -------------------------------------------------------- collectives
    def _all_reduce(self, tensor: torch.Tensor) -> None:
        with _contiguous(tensor) as flat:
            per = CHUNK // flat.element_size()
            for start in range(0, flat.numel(), per):
                part = flat[start : start + per]
                count = part.numel()
                self._mine().view(flat.dtype)[:count].copy_(part)
                self._sum(self._publish().view(flat.dtype)[:, :count], part)

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        with _contiguous(output) as out, _contiguous(input, copy_back=False) as inp:
            source, target = inp.view(torch.uint8), out.view(torch.uint8)
            size = source.numel()
            for start in range(0, size, CHUNK):
                count = min(CHUNK, size - start)
                self._mine()[:count].copy_(source[start : start + count])
                slots = self._publish()
                for r in range(self.world):
                    target[r * size + start : r * size + start + count].copy_(slots[r, :count])

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        with _contiguous(output) as out, _contiguous(input, copy_back=False) as inp:
            world, size = self.world, out.numel()
            rows = inp.view(world, size)  # row q: what this rank adds to rank q's result
            per = CHUNK // (world * out.element_size())
            for start in range(0, size, per):
                count = min(per, size - start)
                mine = self._mine().view(out.dtype)[: world * per].view(world, per)
                mine[:, :count].copy_(rows[:, start : start + count])
                pieces = self._publish().view(out.dtype)[:, : world * per].view(world, world, per)
                self._sum(pieces[:, self.rank, :count], out[start : start + count])

    def _all_reduce_shared(self, tensor: torch.Tensor, copies: list[torch.Tensor]) -> None:
        """In a buffer every rank maps: sum this rank's 1/N of the region over all copies, write it into all."""
        self._publish()  # this rank's region is written: peers may read it
        count = tensor.numel()
        lo, hi = count * self.rank // self.world, count * (self.rank + 1) // self.world
        step = CHUNK // tensor.element_size()
        for start in range(lo, hi, step):  # a chunk at a time: the sum is still in cache when it is copied out
            end = min(start + step, hi)
            rows = [copy[start:end] for copy in copies]
            mine = rows[self.rank]
            self._sum(rows, mine)
            for q, row in enumerate(rows):
                if q != self.rank:
                    row.copy_(mine)
        self._publish()  # this rank's part is in every copy, and it reads no copy any more

    def _reduce_scatter_shared(self, output: torch.Tensor, copies: list[torch.Tensor]) -> None:
        """In a buffer every rank maps: this rank's slice summed over all copies, into its own copy and ``output``."""
        self._publish()
        size = output.numel()
        lo, step = self.rank * size, CHUNK // output.element_size()
        for start in range(lo, lo + size, step):  # a chunk at a time: bounds _sum's scratch tensor
            end = min(start + step, lo + size)
            rows = [copy[start:end] for copy in copies]
            self._sum(rows, rows[self.rank])
        mine = copies[self.rank][lo : lo + size]
        if output.data_ptr() != mine.data_ptr():
            output.copy_(mine.view_as(output))
        self._publish()  # done reading the peers' slices: they may write their buffers again

    @staticmethod
    def _sum(rows: Any, out: torch.Tensor) -> None:
        """``out`` = rows[0] + rows[1] + ..., in rank order: the same bits on every rank.

        ``out`` may be one of the rows; past the first two, that row is read last, so the partial sum
        goes to a scratch tensor first.
        """
        late = any(row.data_ptr() == out.data_ptr() for row in rows[2:])
        total = torch.add(rows[0], rows[1]) if late else torch.add(rows[0], rows[1], out=out)
        for r in range(2, len(rows)):
            total.add_(rows[r])
        if late:
            out.copy_(total)

    # ------------------------------------------------- buffers every rank maps
    def allocate(self, numel: int, dtype: torch.dtype, exchange: Callable[[bytes], list[bytes]],
                 agree: Callable[[bool], bool]) -> Optional[torch.Tensor]:
        """Collective: a zeroed flat tensor in memory every rank maps, or None (then allocate privately).

        ``exchange(offer)`` returns every rank's bytes (an all-gather); ``agree(ok)`` as for :func:`open_segment`.
        """
        nbytes = max(numel * torch.empty(0, dtype=dtype).element_size(), 1)
        offer, reason = _create(_HEADER + nbytes)
        offers = [offer]
        mappings: list[Optional[mmap.mmap]] = []
        try:
            offers = exchange(offer)
            for peer in offers:
                mapped, why = _attach(peer, _HEADER + nbytes) if peer else (None, "no segment")
                reason = reason or why
                mappings.append(mapped)
            usable = agree(not reason)
        finally:
            # Every rank removes every file it knows of: a peer killed after the exchange cannot remove its own.
            _remove_all(offers)
        own = mappings[self.rank]
        if not usable or own is None:
            return None
        mine = torch.frombuffer(own, dtype=torch.uint8, offset=_HEADER, count=nbytes)
        copies: list[Optional[torch.Tensor]] = [
            None if r == self.rank or mapped is None else
            torch.frombuffer(mapped, dtype=torch.uint8, offset=_HEADER, count=nbytes)
            for r, mapped in enumerate(mappings)]
        self._shared[mine.data_ptr()] = (nbytes, copies)
        # When the last view of this rank's buffer is freed, its mapping goes, and with it the peers' copies.
        # (A tensor's Python object is no handle on its lifetime: torch makes a new one for every `_base`.)
        weakref.finalize(own, self._shared.pop, mine.data_ptr(), None)
        return mine.view(dtype)[:numel]

    def _copies(self, tensor: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """Every rank's copy of ``tensor``'s region (this rank's: ``tensor``), when it lies in a shared buffer."""
        if not self._shared or not tensor.is_contiguous():
            return None
        address, count = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        # (a copy of the items: the worker thread reads them while a finalizer may drop a buffer's entry)
        for base, (nbytes, copies) in list(self._shared.items()):
            offset = address - base
            if 0 <= offset and offset + count <= nbytes:
                return [tensor.view(-1) if copy is None else copy[offset : offset + count].view(tensor.dtype)
                        for copy in copies]
        return None


#: what a segment's worker runs: ``(segment, kind, tensors, work)``, ``kind`` one of :data:`KINDS`; the job holds
#: its segment (the worker only weakly), so a segment whose owner let go still runs what it was handed: its peers
#: wait for their halves of those collectives
Job = tuple["SharedSegment", str, tuple[torch.Tensor, ...], ShmWork]
#: the kinds of collective a segment runs, with their tensors: ``(tensor,)``, ``(output, input)``, ``(output, input)``
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def _serve(jobs: "queue.SimpleQueue[Optional[Job]]", segment: "weakref.ref[SharedSegment]") -> None:
    """The worker thread: run the segment's collectives in order until it is closed or freed."""
    while True:
        try:
            job = jobs.get(timeout=1.0)
        except queue.Empty:
            if segment() is None:
                return
            continue
        owner = segment()
        if job is None or owner is None:
            return
        owner._run(job)
        del owner, job  # hold nothing between jobs


class _contiguous:
    """``tensor`` as a flat contiguous view, or a flat copy written back on exit (``copy_back``)."""

    def __init__(self, tensor: torch.Tensor, copy_back: bool = True) -> None:
        self.tensor = tensor
        self.copy = not tensor.is_contiguous()
        self.copy_back = copy_back

    def __enter__(self) -> torch.Tensor:
        self.flat = (self.tensor.contiguous() if self.copy else self.tensor).view(-1)
        return self.flat

    def __exit__(self, *exc: Any) -> None:
        if self.copy and self.copy_back and exc[0] is None:
            self.tensor.copy_(self.flat.view_as(self.tensor))


# ------------------------------------------------------- a group's handle
#: what a set-up collective's failure becomes: ``fault(operation, cause)`` returns the error to raise
Fault = Callable[[str, BaseException], BaseException]


class SharedMemory:
    """One group's shared-memory transport, set up on request: the handle a ``Comm`` keeps.

    Holds the segment (None until :meth:`open` succeeded on every rank) and runs the set-up collectives itself,
    on the process group outside the ledger.  ``pg`` is None where shared memory cannot apply (one rank, not gloo).
    """

    _OFFER = 512  # bytes: a segment's path and token

    def __init__(self, pg: Any, rank: int, world: int, timeout: float, fault: Fault) -> None:
        self._pg = pg
        self.rank, self.world = rank, world
        self._timeout = timeout
        self._limit = timedelta(seconds=timeout)
        self._fault = fault
        #: where gloo's all-reduce, reduce-scatter and all-gather of CPU tensors go instead
        self.segment: Optional[SharedSegment] = None
        #: why shared memory is not used, when it was asked for and could not be
        self.refused = ""

    @property
    def active(self) -> bool:
        """Whether data collectives of CPU tensors go through shared memory."""
        return self.segment is not None

    def open(self) -> None:
        """Collective: map a segment on every rank, or keep the backend (:attr:`refused` says why)."""
        if self._pg is None or self.segment is not None:
            return
        ranks = dist.get_process_group_ranks(self._pg)
        self.segment, self.refused = open_segment(self.rank, self.world, ranks, self._timeout, self._share,
                                                  self._agree)

    def close(self) -> None:
        """Stop using shared memory (its worker thread ends once the collectives in flight are done)."""
        if self.segment is not None:
            self.segment.close()
            self.segment = None

    def abandon(self) -> None:
        """The group is broken: the segment's worker stops waiting for peers (:meth:`SharedSegment.abandon`)."""
        if self.segment is not None:
            self.segment.abandon()

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Collective while :attr:`active`: a zeroed flat tensor every rank maps (a collective over a region of
        it then reads the peers' copies in place); else, or for another device, a private one."""
        # numel is the same on every rank, so all skip the set-up alike (nothing trains: an empty buffer)
        if self.segment is not None and device.type == "cpu" and numel > 0:
            tensor = self.segment.allocate(numel, dtype, self._exchange, self._agree)
            if tensor is not None:
                return tensor
        return torch.zeros(numel, dtype=dtype, device=device)

    def describe(self, backend: str) -> str:
        """How the group's data collectives travel, in words (``backend``: the group's own)."""
        if self.segment is not None:
            return f"shared memory ({backend} for the rest)"
        return f"{backend} ({self.refused})" if self.refused else backend

    def name(self, backend: str) -> str:
        """``shared memory`` or ``backend``."""
        return "shared memory" if self.segment is not None else backend

    # ------------------------------------------------- set-up collectives
    def _offer_tensor(self, offer: bytes) -> torch.Tensor:
        buffer = torch.zeros(self._OFFER, dtype=torch.uint8)
        if offer:
            buffer[: len(offer)] = torch.frombuffer(bytearray(offer), dtype=torch.uint8)
        return buffer

    def _opts(self, cls: Any, **fields: Any) -> Any:
        opts = cls()
        opts.timeout = self._limit
        for field, value in fields.items():
            setattr(opts, field, value)
        return opts

    def _share(self, offer: bytes) -> bytes:
        """Rank 0's ``offer`` on every rank."""
        buffer = self._offer_tensor(offer)
        opts = self._opts(dist.BroadcastOptions, rootRank=0, rootTensor=0)
        self._raw(lambda: self._pg.broadcast([buffer], opts), "sharing a segment's name")
        return bytes(buffer.tolist()).rstrip(b"\0")

    def _exchange(self, offer: bytes) -> list[bytes]:
        """Every rank's ``offer``, in rank order."""
        buffer = self._offer_tensor(offer)
        every = [torch.zeros(self._OFFER, dtype=torch.uint8) for _ in range(self.world)]
        opts = self._opts(torch._C._distributed_c10d.AllgatherOptions)
        self._raw(lambda: self._pg.allgather([every], [buffer], opts), "exchanging segment names")
        return [bytes(row.tolist()).rstrip(b"\0") for row in every]

    def _agree(self, ok: bool) -> bool:
        """True only if ``ok`` on every rank."""
        flag = torch.tensor([int(ok)], dtype=torch.int64)
        opts = self._opts(dist.AllreduceOptions, reduceOp=dist.ReduceOp.MIN)
        self._raw(lambda: self._pg.allreduce([flag], opts), "agreeing to use shared memory")
        return bool(flag.item())

    def _raw(self, start: Callable[[], Any], what: str) -> None:
        """A set-up collective, waited on; a failure becomes the group's named error."""
        try:
            start().wait()
        except RuntimeError as exc:
            raise self._fault(f"setting up shared-memory collectives ({what})", exc) from exc


# ------------------------------------------------------------------ setting up
def open_segment(rank: int, world: int, peers: list[int], timeout: float,
                 share: Callable[[bytes], bytes], agree: Callable[[bool], bool]) -> tuple[Optional[SharedSegment], str]:
    """Map one segment on every rank of a group, or none (then with the reason).

    Collective: ``share(name)`` returns rank 0's bytes on every rank (a
    broadcast); ``agree(ok)`` is True only if it is True on every rank.
    """
    size = _HEADER + 2 * world * CHUNK
    reason = supported(world)
    offer = b""
    if rank == 0 and not reason:
        offer, reason = _create(size)
    try:
        offer = share(offer)
        mapped: Optional[mmap.mmap] = None
        if not reason:
            mapped, reason = _attach(offer, size) if offer else (None, "rank 0 could not create the segment")
        usable = agree(not reason)
    finally:
        # Once the vote passed every rank has mapped the file; on an error, a peer is gone or will not map it.
        # Any rank that knows the name removes it: rank 0 may be the one that was killed.
        _remove_all([offer])
    if not usable:
        return None, reason or "another rank could not map the segment"
    assert mapped is not None
    return SharedSegment(mapped, rank, world, peers, timeout), ""


def _create(size: int) -> tuple[bytes, str]:
    """A new file of ``size`` bytes, with room reserved (no SIGBUS later), and a token in it."""
    sweep()
    path = os.path.join(_DIRECTORY, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
    token = secrets.randbits(62)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            with mmap.mmap(fd, _HEADER) as header:
                struct.pack_into("q", header, 8 * _TOKEN, token)
        finally:
            os.close(fd)
    except OSError as exc:
        _remove_all([path.encode()])
        return b"", f"cannot create {path} ({size} bytes): {exc.strerror}"
    return f"{path}\n{token}".encode(), ""


def _attach(offer: bytes, size: int) -> tuple[Optional[mmap.mmap], str]:
    path, token = offer.decode().split("\n")
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            mapped = mmap.mmap(fd, size)
        finally:
            os.close(fd)
    except OSError as exc:
        return None, f"cannot map {path}: {exc.strerror} (ranks on several hosts?)"
    if struct.unpack_from("q", mapped, 8 * _TOKEN)[0] != int(token):
        return None, f"{path} holds another segment (ranks on several hosts?)"
    return mapped, ""


def _remove_all(offers: list[bytes]) -> None:
    for offer in offers:
        if offer:
            try:
                os.unlink(offer.decode().split("\n")[0])
            except OSError:
                pass  # already removed by another rank


def sweep() -> list[str]:
    """Remove this user's segment files whose creating process no longer exists (a creator killed before its peers
    learnt the name: docs/faults.md, "comms"); return their names.  A file lives only for the seconds of one set-up,
    so one whose creator is gone is never in use."""
    removed: list[str] = []
    try:
        names = os.listdir(_DIRECTORY)
    except OSError:
        return removed
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or running(int(match.group(1))):
            continue
        path = os.path.join(_DIRECTORY, name)
        try:
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue  # removed meanwhile, or not ours
    return removed
