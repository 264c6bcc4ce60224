"""While a rank waits for the others, it reads the errors they published: a rank that raised will not come.

Every wait is cut into slices of :data:`SLICE_S`; between them the waiter reads one store counter that every
publication moves, and the peers' records only when it moved (:meth:`PeerErrors.find`).  ``Comm`` waits the
slices, beside the collectives (every gradient's path waits on some); this module reads what the peers
published.  gloo's reduce-scatter, which ignores a timed wait, is waited for on a helper thread (:class:`Waiter`).
When a published error means "that rank will not come" (a stale one must not stop a healthy job), and what torch's
works do with a timed wait (measured), is in docs/faults.md ("Reading published errors while waiting").
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
        """A peer whose published error means it will not join (see the module docstring): its rank and the error in
        words; None if none.  ``seq``: this rank waits on collective ``seq`` of group ``key`` (None: an agreement)."""
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
    raised (``Comm`` waits for ``done`` in slices)."""

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
    """One thread that waits, in order, for the works handed to it (a group's reduce-scatters over gloo); it ends
    after :data:`_IDLE_S` seconds without work and starts again with the next one (a dropped group leaves none)."""

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
