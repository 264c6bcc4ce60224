"""Liveness records in the c10d store: a heartbeat per rank, and a note from a rank that failed.

A daemon thread per process writes ``alive/<rank>`` every ``comms.timeout / 30`` seconds (0.05 to 5): a beat
counter and what the process is doing.  A rank blocked in a collective still beats (it releases the GIL); a
dead one stops, so the others tell *gone* from *alive but elsewhere*.  A rank that raises writes
``fault/<rank>`` and adds one to ``published`` (what waiting peers poll, :mod:`.published`).  Nothing here is
on the training path: one store ``set`` per beat.  See docs/faults.md.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import socket
import threading
import time
from typing import Any, Callable, Optional

import torch.distributed as dist

from . import ledger as _ledger
from .errors import StoreRecordError
from .ledger import current_activity, ledgers

__all__ = ["PUBLISHED_KEY", "Heartbeat", "clear_fault", "fault_record", "heartbeat", "innermost", "publish_fault",
           "published", "read_json", "read_record", "start"]

_ROOT = "shardwise/faults"
MIN_INTERVAL = 0.05
MAX_INTERVAL = 5.0


def _alive_key(rank: int) -> str:
    return f"{_ROOT}/alive/{rank}"


def _fault_key(rank: int) -> str:
    return f"{_ROOT}/fault/{rank}"


#: a counter every publication (and withdrawal) of a fault record adds one to
PUBLISHED_KEY = f"{_ROOT}/published"


def snapshot() -> dict[str, Any]:
    """What this process is doing now, as the records carry it."""
    return {"doing": current_activity(), "groups": {ledger.key: ledger.status() for ledger in ledgers()}}


class Heartbeat:
    """The beating thread of this process (one per process, whatever the number of groups)."""

    def __init__(self, store: Any, rank: int, interval: float) -> None:
        self.store = store
        self.rank = rank
        self.interval = interval
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardwise-heartbeat", daemon=True)
        self._host = socket.gethostname()
        #: the beats' own connection to the store: requests on one TCPStore client run one at a time, so a
        #: `store.wait` on the job's store (the user's, or torch's) held every beat until it returned, and a
        #: rank waiting there was judged gone (measured: one beat in a 2 s wait, 40 on a connection of its own)
        self._beating = _own_connection(store)

    def start(self) -> None:
        self._beat()  # the first record exists before any collective can fail
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone (group destroyed, host down): stop beating
                return

    def _beat(self) -> None:
        self.beats += 1
        record = {"beat": self.beats, "interval": self.interval, "pid": os.getpid(), "host": self._host,
                  **snapshot()}
        self._beating.set(_alive_key(self.rank), json.dumps(record))


def _own_connection(store: Any) -> Any:
    """A connection of its own to ``store`` when it is a TCPStore (perhaps under prefixes); else ``store``
    (a FileStore's `wait` polls the file and holds nothing up: 39 beats of 40 in a 2 s wait, measured)."""
    if not isinstance(innermost(store), dist.TCPStore):
        return store
    try:
        return store.clone()
    except (RuntimeError, AttributeError):  # a torch without `Store.clone`, or a store that cannot be cloned
        return store


def innermost(store: Any) -> Any:
    """The store under any prefix stores."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


_CURRENT: Optional[Heartbeat] = None
_LOCK = threading.Lock()


def heartbeat() -> Optional[Heartbeat]:
    """This process's heartbeat, if one runs."""
    return _CURRENT


def start(store: Any, rank: int, timeout: float) -> Heartbeat:
    """Make sure this process beats into ``store`` at least as often as ``timeout`` needs."""
    global _CURRENT
    wanted = min(max(timeout / 30.0, MIN_INTERVAL), MAX_INTERVAL)  # a peer is judged gone well within `timeout`
    with _LOCK:
        current = _CURRENT
        if current is not None and current.store is store and current.rank == rank and current.running:
            current.interval = min(current.interval, wanted)
            return current
        if current is not None:
            current.stop()
        _CURRENT = Heartbeat(store, rank, wanted)
        _CURRENT.start()
        return _CURRENT


@atexit.register
def _stop_at_exit() -> None:
    # A daemon thread inside a store call while the interpreter tears down can crash the exit.
    if _CURRENT is not None:
        _CURRENT.stop()


#: the error this process published last (empty: none), read in place by every agreement (``Comm.agree``, on
#: every step's path) to know whether one is left to clear
PUBLISHED: list[str] = []


def publish_fault(error: str, comm: bool, doing: Optional[str] = None) -> None:
    """Tell the other ranks this rank failed and why (``comm``: it only saw a collective fail).

    ``doing`` names the engine call the error left (the activity has been popped by then).
    """
    beat = _CURRENT
    # a collective failing after this rank's own error was published (a peer gave up because of it) leaves that
    # error in the record: it is the cause the peers must name, and a record a peer is reading
    if beat is None or (comm and _ROOT_CAUSE):
        return
    # `failures`: how many engine calls of this process had failed once this one did (a waiting peer judges the
    # record by it, :mod:`.published`)
    record = {"error": error, "comm": comm, "time": time.time(), **snapshot(), "failures": _ledger.doing.failures}
    if doing is not None:
        record["doing"] = doing
    try:
        beat.store.set(_fault_key(beat.rank), json.dumps(record))
        PUBLISHED[:] = [error]
        _ROOT_CAUSE[:] = [] if comm else [True]
        beat.store.add(PUBLISHED_KEY, 1)  # waiting peers read the records only when this count moved
    except Exception:  # noqa: BLE001 - the store is unreachable: the peers will see this rank as gone
        pass


#: whether the record published is this rank's own error (not a collective it saw fail)
_ROOT_CAUSE: list[bool] = []


def published() -> Optional[str]:
    """The error this process published last, until its ranks agree on an operation again."""
    return PUBLISHED[0] if PUBLISHED else None


def clear_fault() -> None:
    """Every rank passed an agreement since: the error published earlier was handled by all (or by none and they
    stopped), it no longer explains anything."""
    beat = _CURRENT
    if not PUBLISHED or beat is None:
        return
    PUBLISHED.clear()
    _ROOT_CAUSE.clear()
    try:
        beat.store.delete_key(_fault_key(beat.rank))
        beat.store.add(PUBLISHED_KEY, 1)
    except Exception:  # noqa: BLE001 - best effort: a stale note only adds a line to a peer's message
        pass


def read_record(store: Any, rank: int) -> Optional[dict[str, Any]]:
    """``rank``'s latest heartbeat record (None if it never beat); StoreRecordError if it is not one."""
    return read_json(store, _alive_key(rank), _beat_problem)


def fault_record(store: Any, rank: int) -> Optional[dict[str, Any]]:
    """What ``rank`` published when it failed (None if nothing); StoreRecordError if it is not that."""
    return read_json(store, _fault_key(rank), _fault_problem)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _beat_problem(record: dict[str, Any]) -> Optional[str]:
    if not (isinstance(record.get("beat"), int) and _number(record.get("interval", 1.0))
            and record.get("interval", 1.0) > 0):
        return "a heartbeat record has an integer `beat` and a positive `interval`"
    return None


def _fault_problem(record: dict[str, Any]) -> Optional[str]:
    return None if isinstance(record.get("error"), str) else "a fault note has a text `error`"


def read_json(store: Any, key: str, problem: Callable[[dict[str, Any]], Optional[str]]) -> Optional[dict[str, Any]]:
    """The JSON object in store key ``key`` (None if absent), which ``problem`` finds right (returns None).

    Only shardwise's ranks write these keys: anything else is a :class:`StoreRecordError` naming the key.
    """
    if not store.check([key]):  # `get` would block until the key exists: ask first
        return None
    raw = store.get(key)
    try:
        value = json.loads(raw)
    except ValueError:  # also UnicodeDecodeError
        value = None
    found = problem(value) if isinstance(value, dict) else "expected a JSON object"
    if found is None:
        return value  # type: ignore[no-any-return]
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    beat = _CURRENT
    raise StoreRecordError(
        f"rank {beat.rank if beat is not None else '?'}: the c10d store key `{key}` holds {text[:80]!r}, which no "
        f"shardwise rank writes ({found}); another program wrote to the job's store: keep the store's port closed "
        "to other programs, and run every rank with the same shardwise version (`shardwise env`)",
        rank=beat.rank if beat is not None else 0,
    )
