"""While a rank waits for the others, it reads the errors they published: a rank that raised will not come.

A rank that raises in an engine call publishes its error (:mod:`.heartbeat`),
and the ranks waiting for it used to read that only after their own wait
failed, at ``comms.timeout``.  Now every wait is cut into slices of
:data:`SLICE_S`: the work is waited for a slice at a time, and between slices
the waiter reads one store counter that every publication moves, and the
peers' records only when it moved (:meth:`PeerErrors.find`).  A slice that completes costs nothing more
than the wait itself; the backend's own timeout (``comms.timeout``) still
ends the work.  The slices are waited for by :class:`~shardwise.comm.distributed.Comm`, beside the collectives
(every gradient's path waits on some); what the peers published is read here, once a slice ran out.

What torch 2.13's gloo works do with ``Work.wait(timeout)`` (measured, two
ranks, the peer 1 s late): an all-reduce, all-gather or broadcast raises
``Operation timed out!`` when the slice runs out and stays in flight: a later
wait completes it with the right result (9 slices of 0.1 s, then the sum).
A reduce-scatter (``reduce_scatter_single`` and the list form alike) ignores
the timeout and blocks until done, and its ``is_completed()`` stays False even
after it finished, so it cannot be polled either: such a work is waited for on
a helper thread (:class:`Waiter`), and its waiter waits for that thread's
signal in slices.  The backend's timeout still ends it there.  NCCL's data
collectives are waited for as before (a NCCL wait orders CUDA streams, and a
timed one may abort the communicator); the gloo control group's exchanges
read published errors on every backend.

Which published error means "that rank will not come" (a stale one must not stop a healthy job):

* a peer whose collective failed (``comm``): its process group is broken, it
  issues nothing more on it;
* a peer whose engine calls failed more often than this rank's
  (:attr:`~.ledger.doing.failures`; every agreement compares the counts, so
  they were equal at the last one): it failed in the operation now running
  and this rank did not, so it will not come to the next agreement as an
  equal.  For a data collective, only when the peer had not issued that
  collective when it failed (``seq``): one it issued completes.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Optional

from . import ledger as _ledger
from .heartbeat import PUBLISHED_KEY, fault_record, heartbeat
from .ledger import Ledger

__all__ = ["RAN_OUT", "SLICE_S", "PeerErrors", "PeerPublished", "Waited", "Waiter", "errors_of"]

#: seconds a wait lasts before the waiter looks at what its peers published (a peer's error is named this
#: long after it was published, at most, plus one store read)
SLICE_S = 0.2
#: what a timed ``Work.wait`` raises when the slice ran out and the work goes on (c10d's ``Work::wait``)
RAN_OUT = "Operation timed out!"


class PeerPublished(RuntimeError):
    """A peer published an error that means it will not join what this rank waits for (the fault layer turns
    it into a :class:`~.errors.PeerFailedError` naming that peer)."""


class PeerErrors:
    """The fault records of ``peers`` (global ranks), read again whenever the publication counter moved."""

    def __init__(self, store: Any, peers: list[int]) -> None:
        self.store = store
        self.peers = peers
        self._count = -1
        self._records: dict[int, dict[str, Any]] = {}

    def find(self, key: Optional[str] = None, seq: Optional[int] = None) -> Optional[tuple[int, str]]:
        """A peer whose published error means it will not join (see the module docstring): its rank and the
        error in words; None if none.  ``seq``: this rank waits on collective ``seq`` of group ``key`` (None:
        an agreement)."""
        count = int(self.store.add(PUBLISHED_KEY, 0))
        if count != self._count:
            self._count = count
            self._records = {}
            for rank in self.peers:
                record = fault_record(self.store, rank)
                if isinstance(record, dict):
                    self._records[rank] = record
        for rank, record in self._records.items():
            if _will_not_come(record, key, seq):
                doing = record.get("doing", "an engine call")
                return rank, f"rank {rank} raised `{record.get('error')}` in {doing}, and will not join"
        return None


def _will_not_come(record: dict[str, Any], key: Optional[str], seq: Optional[int]) -> bool:
    if record.get("comm") is True:
        return True
    failures = record.get("failures")
    if not isinstance(failures, int) or failures <= _ledger.doing.failures:
        return False  # this rank failed as often: it failed the same way, and the peer will come as it does
    if seq is None or key is None:
        return True
    groups = record.get("groups")
    position = groups.get(key) if isinstance(groups, dict) else None
    issued = position.get("seq") if isinstance(position, dict) else None
    return not isinstance(issued, int) or issued < seq


def errors_of(ledger: Ledger, rank: int) -> Optional[PeerErrors]:
    """The reader of ``ledger``'s peers (made on first use; None without a heartbeat: one process)."""
    if ledger.peer_errors is None:
        beat = heartbeat()
        if beat is None:
            return None
        ledger.peer_errors = PeerErrors(beat.store, [r for r in ledger.ranks if r != rank])
    errors: PeerErrors = ledger.peer_errors
    return errors


# ------------------------------------------------------------ works whose own wait cannot be cut
class Waited:
    """A work waited for on a :class:`Waiter`'s thread: ``done`` is set once it finished, ``error`` is what it
    raised (``Comm`` waits for ``done`` in slices, as for every work a thread of shardwise finishes)."""

    __slots__ = ("work", "done", "error", "worker")

    def __init__(self, work: Any) -> None:
        self.work = work
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        #: the thread that finishes it (None: the waiter's, which never dies with a work in its queue)
        self.worker: Optional[threading.Thread] = None

    def run(self) -> None:
        try:
            self.work.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            self.error = exc
        finally:
            self.done.set()


class Waiter:
    """One thread that waits, in order, for the works handed to it (a group's reduce-scatters over gloo).

    The thread ends after :data:`_IDLE_S` seconds without work and starts again with the next one, so a
    dropped group leaves no thread behind.
    """

    _IDLE_S = 5.0

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Waited] = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def watch(self, work: Any) -> Waited:
        """``work``, waited for on the thread from now on."""
        waited = Waited(work)
        self._queue.put(waited)
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=_serve, args=(self._queue, self._IDLE_S),
                                                name="shardwise-waiter", daemon=True)
                self._thread.start()
        return waited


def _serve(jobs: "queue.SimpleQueue[Waited]", idle: float) -> None:
    while True:
        try:
            job = jobs.get(timeout=idle)
        except queue.Empty:
            return
        job.run()
        del job  # hold nothing between works
