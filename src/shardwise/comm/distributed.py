"""The one place that calls ``torch.distributed``.

Everything else in shardwise talks to a :class:`Comm`: a process group plus the
handful of collectives the engine needs, each of which counts the bytes this
rank sends (ring-algorithm accounting), so tests and the benchmark can compare
traffic with ZeRO theory.  With world size 1 every collective is a no-op, which
is what lets a one-process run work with no launcher at all.

No collective waits forever.  Each is issued with ``comms.timeout`` as its own
backend timeout (so gloo itself gives up, and nothing is left running that
could block the process's exit), and a failure (a peer's socket closed, the
timeout passed) becomes a :class:`~shardwise.faults.CommError` that names every
rank and the collective it was in (:mod:`shardwise.faults`).  Every collective
is recorded in its group's ledger: a sequence number, a rolling fingerprint the
engine's step check compares across ranks, and a short log for the messages.

On gloo, an engine's ``Comm`` also carries its all-reduce, reduce-scatter and
all-gather of CPU tensors through shared memory when every rank is on one host
(its handle ``Comm.shm``, set up by :mod:`.shm`); the ledger, the byte counts and
the failures are the same whichever way a collective travels.
"""

from __future__ import annotations

import os
import pickle
from collections import Counter
from datetime import timedelta
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from .. import faults
from ..faults import announce, control, published
from ..faults.ledger import Entry, Ledger, ledger_for
from . import exit as _exit
from . import shm as _shm
from .placement import require_gpu, visible_gpus

__all__ = ["Comm", "DEFAULT_TIMEOUT", "Work", "group_key", "init_distributed"]


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
            _exit.forget(work)
        return True

    def wait_for(self, seconds: float) -> bool:
        """Wait at most ``seconds`` for each work still in flight: whether all are done (:mod:`.faults.published`)."""
        while self.works:
            if not published.finished(self.works[0], seconds):
                return False
            _exit.forget(self.works.pop(0))
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
    """Initialise the default process group from torchrun's environment.

    Reads ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` as torchrun sets
    them; picks NCCL when CUDA is available and gloo otherwise.  Without those
    variables (a plain ``python train.py``) it creates a one-rank gloo group that
    needs no network, so code written for many ranks runs unchanged on one.
    Calling it when a group already exists does nothing.  With NCCL, a
    ``LOCAL_RANK`` that names no visible GPU is a :class:`~shardwise.comm.placement.DeviceError`
    saying so, before CUDA's "invalid device ordinal" can.
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
            if self.comm._gloo:
                # in slices, reading what the peers published: one that raised before issuing it is named at once
                published.wait(self.work, ledger, self.comm.global_rank, self.entry.seq)
            else:
                self.work.wait()  # NCCL: a wait orders CUDA streams, and a timed one may abort the communicator
        except RuntimeError as exc:
            raise self.comm.fault(f"waiting on {self.entry.describe()}", exc, self.entry.seq) from exc
        finally:
            ledger.waiting = None
        _exit.forget(self.work)
        self.work = None
        return True


class Comm:
    """A process group and the collectives shardwise uses, with byte counters.

    ``bytes_sent`` maps a collective's name to the bytes this rank sent through
    it, using ring-algorithm accounting: all-reduce ``2(N-1)/N·S``,
    reduce-scatter and all-gather ``(N-1)/N·S`` of the full-size tensor,
    broadcast ``S`` from the source, scatter ``(N-1)/N·S`` from the source,
    ``send`` ``S`` from the sender.

    ``timeout`` bounds every collective (seconds); ``debug`` checks before each
    one that every rank issues the same (``comms.debug``).  A collective's
    optional ``label`` says what it carries (``unit 3 `fc.weight` ``) in errors.
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

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

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
        entry = ledger.record(kind, tensor.numel(), tensor.dtype, label)
        if self.debug:
            control.before(ledger, self.global_rank, self.timeout,
                           ledger.key_of(kind, entry.numel, entry.dtype, label), entry.describe())
        try:
            work = start()
        except RuntimeError as exc:
            raise self.fault(f"starting {entry.describe()}", exc, entry.seq) from exc
        watched = _Watched(work, self, entry)
        if async_op:
            for raw in getattr(work, "works", [work]):  # a _Group is several broadcasts
                _exit.track(raw)  # so the process's exit can wait for it (shardwise.comm.exit)
            return watched
        watched.wait()
        return _DONE

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
            control.agree(self.ledger, self.global_rank, self.timeout, point, counters, names)

    # ------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False, op: Any = None, label: str = "") -> Work:
        """Sum (or ``op``) ``tensor`` across ranks, in place."""
        if not self.distributed:
            return _DONE
        self._count("all_reduce", 2 * _ring_share(self.world_size) * _nbytes(tensor))
        segment = self.shm.carrier(tensor, summed=True) if op in (None, dist.ReduceOp.SUM) else None
        if segment is not None:
            return self._issue("all_reduce", tensor, label, lambda: segment.all_reduce(tensor), async_op)
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
        segment = self.shm.carrier(output, input, summed=True)
        if segment is not None:
            return self._issue("reduce_scatter", input, label, lambda: segment.reduce_scatter(output, input), async_op)
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
        segment = self.shm.carrier(output, input)
        if segment is not None:
            return self._issue("all_gather", output, label, lambda: segment.all_gather(output, input), async_op)
        if self._gloo and output.numel() >= GLOO_BROADCAST_GATHER_MIN:
            start: Callable[[], Any] = lambda: self._gather_by_broadcast(output, input)  # noqa: E731
        else:
            opts = self._opts(_AllgatherOptions)
            start = lambda: _AG(self._pg, output, input, opts)  # noqa: E731
        return self._issue("all_gather", output, label, start, async_op)

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


# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only
# have the ``_*_base`` names.  Pick once, at import.
_RS = getattr(dist.ProcessGroup, "reduce_scatter_single", None) or dist.ProcessGroup._reduce_scatter_base
_AG = getattr(dist.ProcessGroup, "all_gather_single", None) or dist.ProcessGroup._allgather_base
_AllgatherOptions: Any = torch._C._distributed_c10d.AllgatherOptions
