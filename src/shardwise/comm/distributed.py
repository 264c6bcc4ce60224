"""The one place that calls ``torch.distributed``.

Everything else talks to a :class:`Comm`: a process group and the collectives the engine needs, each counting
the bytes this rank sends (ring-algorithm accounting, compared with ZeRO theory by tests and benchmarks).  With
world size 1 every collective is a no-op, so one process runs with no launcher.  No collective waits forever:
each has ``comms.timeout`` as its backend timeout, is recorded in its group's ledger, and a failure becomes a
:class:`~shardwise.faults.CommError` naming every rank and where it was (:mod:`shardwise.faults`).  On gloo,
data collectives of CPU tensors may travel through shared memory (``Comm.shm``, :mod:`.shm`) with the same
ledger, counts and failures.
"""

from __future__ import annotations

import atexit
import gc
import os
import pickle
import time
import zlib
from collections import Counter
from datetime import timedelta
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from .. import faults
from ..faults import announce, control, heartbeat, published
from ..faults.ledger import ACTIVITY, IDLE, Entry, Ledger, doing, ledger_for, ledgers
from . import shm as _shm
from .placement import require_gpu, visible_gpus

__all__ = ["Comm", "DEFAULT_TIMEOUT", "Work", "group_key", "init_distributed", "wait_all"]


class Work(Protocol):
    """What an asynchronous collective returns: something to wait on."""

    def wait(self) -> Any: ...


class _Done:
    """A finished collective (world size 1, or a skipped empty tensor)."""

    def wait(self) -> bool:
        return True


_DONE = _Done()


class _Group:
    """Several collectives waited on as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
            _UNWAITED.pop(id(work), None)
        return True

    def wait_for(self, seconds: float) -> bool:
        """Wait at most ``seconds`` for each work still in flight: whether all are done (see :func:`_finished`)."""
        while self.works:
            if not _finished(self.works[0], seconds):
                return False
            _UNWAITED.pop(id(self.works.pop(0)), None)
        return True


#: from this many elements, gloo all-gathers run as one broadcast per rank:
#: measured 3x faster than gloo's own all-gather at 10M elements (20 vs 60 ms,
#: 2 ranks), same bytes sent, and no transient full-size buffer.
GLOO_BROADCAST_GATHER_MIN = 1 << 20


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def init_distributed(
    backend: Optional[str] = None, timeout: float = 1800.0, set_device: bool = True
) -> None:
    """Initialise the default process group from torchrun's environment (nothing when one exists).

    Reads ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` as torchrun sets them; NCCL when CUDA is
    available, else gloo.  Without them (a plain ``python train.py``) a one-rank gloo group that needs no network,
    so code written for many ranks runs unchanged on one.  With NCCL, a ``LOCAL_RANK`` naming no visible GPU is a
    :class:`~shardwise.comm.placement.DeviceError` saying so, before CUDA's "invalid device ordinal" can.
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK") or 0
    if backend == "nccl" and set_device:
        require_gpu(local_rank, visible_gpus())
        torch.cuda.set_device(local_rank)
    limit = timedelta(seconds=timeout)
    if rank is None or world is None:
        # No launcher: a private in-memory store is enough for one rank.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=limit)
        return
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=limit)


def _ring_share(world: int) -> float:
    return (world - 1) / world if world > 1 else 0.0


#: seconds a collective may wait for the other ranks (the config's ``comms.timeout``)
DEFAULT_TIMEOUT = 300.0


def group_key(group: Optional[dist.ProcessGroup]) -> str:
    """A process group's name and members, the same on every member (store keys, messages)."""
    group = group if group is not None else dist.group.WORLD
    name = getattr(group, "group_name", "") or "default"
    return f"{name}[{','.join(map(str, dist.get_process_group_ranks(group)))}]"


class _Watched:
    """An issued collective: waiting on it turns a backend failure into a named ``CommError``."""

    __slots__ = ("work", "comm", "entry")

    def __init__(self, work: Any, comm: "Comm", entry: Entry) -> None:
        self.work = work
        self.comm = comm
        self.entry = entry

    def wait(self) -> bool:
        if self.work is None:
            return True
        ledger = self.comm.ledger
        ledger.waiting = self.entry
        try:
            if not self.comm._gloo:
                self.work.wait()  # NCCL: a wait orders CUDA streams, and a timed one may abort the communicator
            elif not _finished(self.work):
                # in slices, reading what the peers published: one that raised before issuing it is named at once
                _wait_sliced(self.work, ledger, self.comm.global_rank, self.entry.seq)
        except RuntimeError as exc:
            raise self.comm.fault(f"waiting on {self.entry.describe()}", exc, self.entry.seq) from exc
        finally:
            ledger.waiting = None
        _UNWAITED.pop(id(self.work), None)
        self.work = None
        return True


def wait_all(works: Sequence[Work]) -> None:
    """Wait for each of ``works`` in turn (one call for a step's works, not one per bucket or unit)."""
    for work in works:
        work.wait()


# ------------------------------------------------------------- waiting in slices
def _finished(work: Any, seconds: float = published.SLICE_S) -> bool:
    """Wait for ``work`` at most ``seconds``: True once it completed (its error raised), False if it goes on."""
    done = getattr(work, "done", None)
    if done is not None:  # finished by a thread of shardwise (shared memory's worker, the reduce-scatter waiter)
        if not done.wait(seconds):
            if work.worker is not None and not work.worker.is_alive():
                raise RuntimeError("the shared-memory collective worker thread has ended")
            return False
        if work.error is not None:
            raise work.error
        return True
    wait_for = getattr(work, "wait_for", None)  # several broadcasts
    if wait_for is not None:
        finished: bool = wait_for(seconds)
        return finished
    try:
        work.wait(timedelta(seconds=seconds))
    except RuntimeError as exc:
        if published.RAN_OUT in str(exc):
            return False
        raise
    return True


def _wait_sliced(work: Any, ledger: Ledger, rank: int, seq: Optional[int] = None) -> None:
    """Wait for ``work`` of group ``ledger`` (collective ``seq``, or an agreement when None) a slice at a time,
    raising :class:`~shardwise.faults.published.PeerPublished` as soon as a peer published an error that means it
    will not join (:mod:`shardwise.faults.published`)."""
    while not _finished(work):
        errors = published.errors_of(ledger, rank)
        found = errors.find(ledger.key, seq) if errors is not None else None
        if found is not None:
            raise published.PeerPublished(found[1])


# ------------------------------------------------- the collectives nobody waited for
# Leave the process cleanly after training: settle gloo's worker threads before Python finalizes.
#
# gloo runs every collective on a worker thread of its process group, and that thread drops its own reference
# to the collective (and so to its tensors) only after the collective finished.  When that is the last
# reference to a tensor Python also knew, dropping it needs the GIL.  Once the interpreter has begun to
# finalize, a foreign thread that asks for the GIL is ended with ``pthread_exit``, whose unwinding through
# gloo's C++ frames calls ``std::terminate``: the process dies with SIGABRT ("terminate called without an
# active exception") after the script has finished and printed its results.  Seen with ZeRO-3 engines, whose
# units gather right up to the last forward: about one run in 40 of ``examples/gan.py`` under ``torchrun`` on a
# loaded 2-core machine (a core dump showed a gloo worker destroying an all-gather inside
# ``Py_FinalizeEx``'s collection).
#
# So at ``atexit`` (before finalization, while every thread can still take the GIL) the collectives shardwise
# started and nobody waited for are waited for, bounded by a few seconds (a dead peer must not hold the exit),
# then one garbage collection runs.  Engines are reference cycles (modules and their hooks), so that collection
# frees their buffers, and, when the script has already called ``destroy_process_group``, their process groups
# too, whose destructors join the worker threads.  Nothing there raises: exit must not fail.

#: how long exit waits for one unwaited collective (seconds)
_WAIT_S = 5.0
#: at most this many unwaited collectives are remembered (the oldest are long finished)
_MAX_TRACKED = 1024

# Keyed by id(): a collective is forgotten when its waiter returns.  Work.is_completed()
# cannot prune this: gloo's reduce-scatter reports False even after a successful wait.
_UNWAITED: dict[int, Any] = {}


def _track(work: Any) -> None:
    """Remember an asynchronous collective until it is waited for."""
    _UNWAITED[id(work)] = work
    if len(_UNWAITED) > _MAX_TRACKED:
        del _UNWAITED[next(iter(_UNWAITED))]


def _settle() -> None:
    for work in list(_UNWAITED.values()):
        try:
            _finished(work, _WAIT_S)
        except Exception:  # a peer died or the group is gone: exit anyway
            pass
    _UNWAITED.clear()
    gc.collect()


atexit.register(_settle)


class Comm:
    """A process group and the collectives shardwise uses, with byte counters.

    ``bytes_sent`` maps a collective's name to the bytes this rank sent through it, in ring-algorithm accounting:
    all-reduce ``2(N-1)/N·S``, reduce-scatter and all-gather ``(N-1)/N·S`` of the full-size tensor, broadcast
    ``S`` from the source, scatter ``(N-1)/N·S`` from the source, ``send`` ``S`` from the sender.  ``timeout``
    bounds every collective (seconds); ``debug`` checks before each one that every rank issues the same
    (``comms.debug``).  A collective's optional ``label`` says what it carries (``unit 3 `fc.weight` ``) in errors.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, timeout: float = DEFAULT_TIMEOUT,
                 debug: bool = False) -> None:
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        else:
            self.rank, self.world_size = 0, 1
        self.bytes_sent: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.timeout = float(timeout)
        self.debug = debug
        #: the process group's backend ("gloo", "nccl"; "none" with no group)
        self.backend = str(dist.get_backend(group)) if dist.is_available() and dist.is_initialized() else "none"
        #: whether the group has more than one rank (every collective is a no-op otherwise)
        self.distributed = self.world_size > 1
        self._gloo = self.world_size > 1 and self.backend == "gloo"
        self.ledger = Ledger("local", [0])
        if self.world_size > 1:
            self._connect()
        #: shared-memory transport for gloo's data collectives of CPU tensors, once opened (:mod:`.shm`)
        self.shm = _shm.SharedMemory(self._pg if self._gloo else None, self.rank, self.world_size, self.timeout,
                                     self.fault)

    def _connect(self) -> None:
        self._pg: Any = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
        self.global_rank = dist.get_rank()
        self.ledger = ledger_for(group_key(self.group), dist.get_process_group_ranks(self._pg), self._pg)
        self._limit = timedelta(seconds=self.timeout)
        self._options: dict[Any, Any] = {}
        self._waiter = published.Waiter()
        faults.watch(self.global_rank, self.timeout)

    # The engine's three calls on the transport; the set-up itself lives in `self.shm` (:mod:`.shm`).
    def open_shared_memory(self) -> None:
        """Collective: on gloo, carry the data collectives of CPU tensors through shared memory, or keep gloo
        (:attr:`transport` says why).  Nothing to do for one rank or another backend."""
        self.shm.open()

    def close_shared_memory(self) -> None:
        """Stop using shared memory (its worker thread ends once the collectives in flight are done)."""
        self.shm.close()

    @property
    def transport(self) -> str:
        """How this group's data collectives travel, in words (logged by the engine)."""
        return self.shm.describe(self.backend)

    def _count(self, name: str, nbytes: float) -> None:
        self.bytes_sent[name] += int(nbytes)
        self.calls[name] += 1

    def reset_counters(self) -> None:
        self.bytes_sent.clear()
        self.calls.clear()

    # ------------------------------------------------------ issuing, failing
    def _opts(self, cls: Any, **fields: Any) -> Any:
        """An options object with this Comm's timeout (cached: built once per kind and fields)."""
        key = (cls, tuple(sorted(fields.items())))
        opts = self._options.get(key)
        if opts is None:
            opts = cls()
            opts.timeout = self._limit
            for name, value in fields.items():
                setattr(opts, name, value)
            self._options[key] = opts
        return opts

    def _issue(self, kind: str, tensor: torch.Tensor, label: str, start: Callable[[], Any], async_op: bool) -> Work:
        """Record, check (``debug``), start and (unless ``async_op``) finish one collective."""
        ledger = self.ledger
        if ledger.broken is not None:
            raise ledger.broken
        if announce.STRICT and ledger.scope is None:
            raise RuntimeError(f"rank {self.rank}: a {kind} ({label or 'no label'}) was issued on process group "
                               f"{ledger.key} outside any announced operation (`SHARDWISE_STRICT_COLLECTIVES=1`), "
                               f"in {faults.current_activity()}: announce the operation that issues it "
                               "(shardwise.faults.announce)")
        entry = self.record(kind, tensor.numel(), tensor.dtype, label)
        if self.debug:
            self.agree([control.DEBUG, ledger.seq, _key(kind, entry.numel, entry.dtype, label)],
                       ["kind", "collective number", "collective"],
                       f"in the collective check (`comms.debug`) before {entry.describe()}")
        try:
            work = start()
        except RuntimeError as exc:
            raise self.fault(f"starting {entry.describe()}", exc, entry.seq) from exc
        watched = _Watched(work, self, entry)
        if async_op:
            for raw in getattr(work, "works", [work]):  # a _Group is several broadcasts
                _track(raw)  # so the process's exit can wait for it (see `_settle`)
            return watched
        watched.wait()
        return _DONE

    def record(self, kind: str, numel: int, dtype: torch.dtype, label: str) -> Entry:
        """Give the next collective of the group its number and fold it into the fingerprint and the log of its
        ledger (:mod:`shardwise.faults.ledger`), here where collectives are issued; a note that is not a
        collective (stage 3's in-place writes) is recorded the same way, for the step check to compare."""
        ledger = self.ledger
        key = _KEYS.get((kind, numel, dtype, label))
        if key is None:
            key = _key(kind, numel, dtype, label)
        ledger.seq += 1
        ledger.fingerprint = ((ledger.fingerprint * 1000003) ^ key) & _MASK
        entry = Entry(ledger.seq, kind, numel, dtype, label, ACTIVITY[-1].text if ACTIVITY else IDLE, time.monotonic())
        ledger.log.append(entry)
        ledger.last = entry
        return entry

    def fault(self, operation: str, exc: BaseException, seq: int = 0) -> BaseException:
        """The error to raise for a failure of this group seen in ``operation`` (the first one sticks)."""
        ledger = self.ledger
        if ledger.broken is None:
            failure = faults.Failure(ledger, self.global_rank, operation, faults.short_cause(exc), self.timeout, seq)
            ledger.broken = faults.diagnose(failure)
            shm = getattr(self, "shm", None)  # (None while the Comm is being made)
            if shm is not None:
                shm.abandon()  # its worker would wait on for a peer that will not come
        return ledger.broken

    def check(self, point: str, counters: Sequence[int], names: Sequence[str]) -> None:
        """The step check: every rank issued the same collectives so far and has the same ``counters``."""
        if self.distributed:
            ledger = self.ledger
            self.agree([control.CHECK, ledger.seq, ledger.fingerprint, *counters],
                       ["kind", "collectives", "fingerprint", *names],
                       f"in the step check at {point} (after collective #{ledger.seq})")

    def agree(self, values: Sequence[int], names: Sequence[str], what: str) -> None:
        """Every rank has the same ``values`` (named by ``names``; the first is the kind of check, ``what`` says
        where this rank is), or every rank raises naming what each did (:mod:`shardwise.faults.control`).

        The exchange is one all-reduce on the group's control group, waited for in slices, here beside the
        collectives: a step's check and a backward's announcement are on every gradient's path.  Setting the
        control group up (once) and naming a disagreement are :mod:`~shardwise.faults.control`'s."""
        ledger, rank = self.ledger, self.global_rank
        if ledger.broken is not None:
            raise ledger.broken
        group = ledger.control if ledger.control is not None else control.open_group(ledger, rank, self.timeout, what)
        # the failure count goes last in every kind of exchange, so any two can be compared there
        row = [*values] + [0] * (control.WIDTH - 1 - len(values)) + [doing.failures]
        try:
            group.count += 1
            group.buffer.copy_(torch.tensor(row + [-v for v in row], dtype=torch.int64))
            work = group.group.allreduce([group.buffer], group.options)
            if not _finished(work, control.SAY_AFTER_S):
                control.say_waiting(group.store, ledger, rank, group.count)  # for a rank in a checkpoint's agreement
                _wait_sliced(work, ledger, rank)
            reduced = group.buffer.tolist()
        except RuntimeError as exc:
            raise control.failed(ledger, rank, self.timeout, what, exc) from exc
        maxima, minima = reduced[: control.WIDTH], [-v for v in reduced[control.WIDTH :]]
        if maxima != minima:
            names = [*names] + [""] * (control.WIDTH - 1 - len(names)) + [control.FAILURES]
            raise control.disagreement(ledger, rank, group, what, row, names, maxima, minima)
        if heartbeat.PUBLISHED and not any(other.broken is not None for other in ledgers()):
            # every rank passed this agreement: an error published before it was handled by all (a broken group's
            # error stays: its peers still need it)
            heartbeat.clear_fault()

    # ------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False, op: Any = None, label: str = "") -> Work:
        """Sum (or ``op``) ``tensor`` across ranks, in place."""
        if not self.distributed:
            return _DONE
        self._count("all_reduce", 2 * _ring_share(self.world_size) * _nbytes(tensor))
        segment = _carrier(self.shm.segment, (tensor,), True) if op in (None, dist.ReduceOp.SUM) else None
        if segment is not None:
            return self._issue("all_reduce", tensor, label, lambda: _post(segment, "all_reduce", tensor), async_op)
        opts = self._opts(dist.AllreduceOptions, reduceOp=op or dist.ReduceOp.SUM)
        return self._issue("all_reduce", tensor, label, lambda: self._pg.allreduce([tensor], opts), async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                       label: str = "") -> Work:
        """Sum ``input`` (N equal chunks) across ranks; this rank keeps chunk ``rank`` in ``output``."""
        if not self.distributed:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _DONE
        self._count("reduce_scatter", _ring_share(self.world_size) * _nbytes(input))
        segment = _carrier(self.shm.segment, (output, input), True)
        if segment is not None:
            return self._issue("reduce_scatter", input, label, lambda: _post(segment, "reduce_scatter", output, input),
                               async_op)
        opts = self._opts(dist.ReduceScatterOptions, reduceOp=dist.ReduceOp.SUM)
        # gloo's reduce-scatter ignores a timed wait: waited for on a thread, so its waiter can read faults
        return self._issue("reduce_scatter", input, label,
                           lambda: self._waiter.watch(_RS(self._pg, output, input, opts)), async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, label: str = "") -> Work:
        """Concatenate every rank's ``input`` into ``output`` (``N × input`` elements)."""
        if not self.distributed:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _DONE
        self._count("all_gather", _ring_share(self.world_size) * _nbytes(output))
        segment = _carrier(self.shm.segment, (output, input), False)
        if segment is not None:
            return self._issue("all_gather", output, label, lambda: _post(segment, "all_gather", output, input), async_op)
        if self._gloo and output.numel() >= GLOO_BROADCAST_GATHER_MIN:
            start: Callable[[], Any] = lambda: self._gather_by_broadcast(output, input)  # noqa: E731
        else:
            opts = self._opts(_AllgatherOptions)
            start = lambda: _AG(self._pg, output, input, opts)  # noqa: E731
        return self._issue("all_gather", output, label, start, async_op)

    def all_gather_each(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], labels: Sequence[str]) -> list[Work]:
        """Start an all-gather of each ``(output, input)`` of ``pairs``, in order (one call for a step's
        buckets); their works, to wait on."""
        return [self.all_gather(output, input, async_op=True, label=label)
                for (output, input), label in zip(pairs, labels)]

    def _gather_by_broadcast(self, output: torch.Tensor, input: torch.Tensor) -> Any:
        """All-gather as one broadcast from each rank, each into its slice of ``output``."""
        n = input.numel()
        mine = output.narrow(0, self.rank * n, n)
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input)
        works = []
        for src in range(self.world_size):
            opts = self._opts(dist.BroadcastOptions, rootRank=src, rootTensor=0)
            works.append(self._pg.broadcast([output.narrow(0, src * n, n)], opts))
        return _Group(works)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False, label: str = "") -> Work:
        """Copy ``tensor`` from group rank ``src`` to every rank, in place."""
        if not self.distributed:
            return _DONE
        if self.rank == src:
            self._count("broadcast", _nbytes(tensor))
        opts = self._opts(dist.BroadcastOptions, rootRank=src, rootTensor=0)
        return self._issue("broadcast", tensor, label, lambda: self._pg.broadcast([tensor], opts), async_op)

    def scatter(self, output: torch.Tensor, inputs: Optional[list[torch.Tensor]], src: int = 0) -> None:
        """Group rank ``src`` sends ``inputs[r]`` to rank ``r``, which receives it in ``output``."""
        if not self.distributed:
            if inputs is not None and output.data_ptr() != inputs[0].data_ptr():
                output.copy_(inputs[0])
            return
        if self.rank == src:
            self._count("scatter", _ring_share(self.world_size) * _nbytes(output) * self.world_size)
        opts = self._opts(dist.ScatterOptions, rootRank=src)
        sources = [list(inputs or [])] if self.rank == src else []
        self._issue("scatter", output, "", lambda: self._pg.scatter([output], sources, opts), False)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (small Python values only: it pickles)."""
        if not self.distributed:
            return [obj]
        data = self._object_tensor(obj)
        sizes = torch.zeros(self.world_size, dtype=torch.int64, device=data.device)
        self.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=data.device),
                        label="object sizes")
        width = int(sizes.max())
        padded = torch.zeros(width, dtype=torch.uint8, device=data.device)
        padded[: data.numel()] = data
        gathered = torch.empty(width * self.world_size, dtype=torch.uint8, device=data.device)
        self.all_gather(gathered, padded, label="pickled objects")
        chunks = gathered.cpu().view(self.world_size, width)
        return [pickle.loads(chunks[r, : int(sizes[r])].numpy().tobytes()) for r in range(self.world_size)]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from group rank ``src`` on every rank (small Python values: it pickles)."""
        if not self.distributed:
            return obj
        data = self._object_tensor(obj if self.rank == src else None)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=data.device)
        self.broadcast(size, src=src, label="object size")
        if self.rank != src:
            data = torch.empty(int(size), dtype=torch.uint8, device=data.device)
        self.broadcast(data, src=src, label="pickled object")
        return pickle.loads(data.cpu().numpy().tobytes())

    def _object_tensor(self, obj: Any) -> torch.Tensor:
        device = torch.device("cuda", torch.cuda.current_device()) if not self._gloo and torch.cuda.is_available() \
            else torch.device("cpu")
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)

    def barrier(self) -> None:
        if self.distributed:
            marker = torch.zeros(0)
            self._issue("barrier", marker, "", lambda: self._pg.barrier(self._opts(dist.BarrierOptions)), False)

    # ------------------------------------------------ point-to-point (pipeline stages)
    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        """Start sending ``tensor`` to group rank ``dst``; keep it unchanged until the work is waited on."""
        self._count("send", _nbytes(tensor))
        return self._p2p(dist.isend(tensor, dst=self._peer(dst, "send to"), group=self.group), "send", tensor, dst)

    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        """Start receiving into ``tensor`` from group rank ``src`` (messages between two ranks arrive in order)."""
        self.calls["recv"] += 1
        return self._p2p(dist.irecv(tensor, src=self._peer(src, "receive from"), group=self.group), "recv", tensor, src)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to group rank ``dst`` and wait until it is out."""
        self.isend(tensor, dst).wait()

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Receive into ``tensor`` from group rank ``src``."""
        self.irecv(tensor, src).wait()

    def _peer(self, peer: int, what: str) -> int:
        """The global rank of group rank ``peer``, which must be another rank of the group."""
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(
                f"rank {self.rank} cannot {what} group rank {peer}: point-to-point needs another rank of "
                f"this {self.world_size}-rank group (0..{self.world_size - 1}, not itself)"
            )
        return dist.get_global_rank(self.group, peer) if self.group is not None else peer

    def _p2p(self, work: Optional[Any], kind: str, tensor: torch.Tensor, peer: int) -> Work:
        # torch types point-to-point works as optional (None only off the group, which `_peer` rules out)
        if work is None:
            return _DONE
        # Point-to-point takes no backend timeout: bound the wait instead.  Not in the
        # fingerprint: the two ends of a send issue different calls by design.
        return _TimedP2P(work, self, f"{kind} of {tensor.numel()} elements with group rank {peer}")


class _TimedP2P:
    """A send or receive, waited on for at most ``comms.timeout``."""

    __slots__ = ("work", "comm", "what")

    def __init__(self, work: Any, comm: Comm, what: str) -> None:
        self.work, self.comm, self.what = work, comm, what

    def wait(self) -> bool:
        try:
            self.work.wait(self.comm._limit)
        except RuntimeError as exc:
            raise self.comm.fault(f"waiting on a {self.what} in {faults.current_activity()}", exc) from exc
        return True


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# ------------------------------------------------------------ recording
_MASK = (1 << 61) - 1
#: every collective's key, once computed (the same collectives recur every step)
_KEYS: dict[tuple[str, int, torch.dtype, str], int] = {}


def _key(kind: str, numel: int, dtype: torch.dtype, label: str) -> int:
    """A number that is the same on every rank for the same collective (``hash`` is salted per process)."""
    key = zlib.crc32(f"{kind}|{numel}|{dtype}|{label}".encode())
    if len(_KEYS) < 4096:
        _KEYS[(kind, numel, dtype, label)] = key
    return key


# ------------------------------------------------------------ shared memory
def _carrier(segment: Optional[_shm.SharedSegment], tensors: tuple[torch.Tensor, ...],
             summed: bool) -> Optional[_shm.SharedSegment]:
    """``segment`` (:mod:`.shm`), when it can carry a collective of ``tensors`` (the same answer on every rank)."""
    if segment is None or any(t.device.type != "cpu" for t in tensors):
        return None
    if summed and any(t.dtype in (torch.bool, torch.complex64, torch.complex128) for t in tensors):
        return None
    return segment


def _post(segment: _shm.SharedSegment, kind: str, *tensors: torch.Tensor) -> _shm.ShmWork:
    """Hand a collective to ``segment``'s worker (a record and a queue's ``put``: the transport's code runs on
    its own thread, as gloo's does)."""
    work = _shm.ShmWork(segment.worker)
    segment.jobs.put((segment, kind, tensors, work))
    return work


# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only
# have the ``_*_base`` names.  Pick once, at import.
_RS = getattr(dist.ProcessGroup, "reduce_scatter_single", None) or dist.ProcessGroup._reduce_scatter_base
_AG = getattr(dist.ProcessGroup, "all_gather_single", None) or dist.ProcessGroup._allgather_base
_AllgatherOptions: Any = torch._C._distributed_c10d.AllgatherOptions
