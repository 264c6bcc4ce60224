"""Turn a failed collective into an error that names every rank and what it was doing.

Called on the rank whose collective failed, and issuing no collective itself: it publishes this rank's failure,
reads the other ranks' records from the c10d store for a few heartbeat intervals, and sorts each peer into
**failed** (it published an error), **gone** (its heartbeat stood still) or **alive** (and where).  The error
class follows the most telling peer: :class:`PeerFailedError`, :class:`RankGoneError`,
:class:`CollectiveMismatchError`, else :class:`CommError`.  A store that answers no read is its host gone
(:func:`.liveness.store_host`).  See docs/faults.md ("Diagnosis").
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import CollectiveMismatchError, CommError, PeerFailedError, RankGoneError, StoreRecordError
from .heartbeat import fault_record, heartbeat, publish_fault, read_record
from .ledger import Ledger
from .liveness import StoreHost, store_host

__all__ = ["AGREE", "RESTART", "Failure", "diagnose", "short_cause"]

#: the longest this rank watches the others' heartbeats before deciding who is gone
_MAX_WATCH_S = 20.0
RESTART = ("the job cannot go on without it: let it exit and restart the job (`shardwise run --max-restarts N "
            "...` restarts every rank), resuming from the last checkpoint")
AGREE = ("every rank must issue the same collectives in the same order: run the same modules (ZeRO-3 gathers "
          "each module's parameters when it runs), the same number of micro-batches per step, and call "
          "`backward` and `step` on every rank together; set `comms.debug: true` to stop at the first "
          "collective that differs")


@dataclass
class Failure:
    """What failed on this rank: the group, the collective (described), the backend's words."""

    ledger: Ledger
    rank: int
    operation: str
    cause: str
    timeout: float
    #: the sequence number of the collective that failed (0: not a data collective, e.g. a check)
    seq: int = 0


@dataclass
class _Peer:
    rank: int
    state: str = "unknown"  # failed | comm | alive | gone
    first: Optional[dict[str, Any]] = None
    record: Optional[dict[str, Any]] = None
    fault: Optional[dict[str, Any]] = None
    watched: float = 0.0
    notes: list[str] = field(default_factory=list)


def short_cause(exc: BaseException) -> str:
    """The backend's message without its source-file prefix, on one line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    text = text.split(". This is typically caused")[0]
    return text[:300]


def diagnose(failure: Failure) -> CommError:
    """Publish this rank's failure, find out about the others, and return the error to raise."""
    publish_fault(f"{failure.operation}: {failure.cause}", comm=True)
    beat = heartbeat()
    peers = [_Peer(r) for r in failure.ledger.ranks if r != failure.rank]
    if beat is None:
        return CommError(f"rank {failure.rank}: {failure.operation} failed: {failure.cause}", rank=failure.rank)
    reads = _Reads()
    try:
        _watch(beat.store, peers, beat.interval, reads)
    except StoreRecordError as exc:  # (the failed wait may have read it first: then it is the cause)
        cause = "" if str(exc) in failure.cause else f", which failed: {failure.cause}"
        return StoreRecordError(f"{exc}. This rank was {failure.operation}{cause}", rank=failure.rank)
    if reads.ok == 0 and reads.error:
        host = store_host(beat.store) or StoreHost("(an address not known here)", None)
        return _store_lost(failure, peers, host, reads.error)
    return _compose(failure, peers)


@dataclass
class _Reads:
    """How the store answered while this rank watched: reads that worked, the first error of one that did not."""

    ok: int = 0
    error: str = ""


def _watch(store: Any, peers: list[_Peer], interval: float, reads: _Reads) -> None:
    start = time.monotonic()
    for peer in peers:
        peer.first = _safe(read_record, store, peer.rank, reads)
    slowest = max([interval] + [float(p.first["interval"]) for p in peers if p.first is not None])
    deadline = start + min(2.5 * slowest + 0.2, _MAX_WATCH_S)
    while True:
        for peer in peers:
            if peer.state == "unknown":
                _look(store, peer, reads)
        if all(p.state != "unknown" for p in peers) or time.monotonic() > deadline:
            break
        time.sleep(min(interval, slowest) / 4)
    for peer in peers:
        peer.watched = time.monotonic() - start
        if peer.state == "unknown":
            peer.state, peer.record = "gone", peer.first


def _look(store: Any, peer: _Peer, reads: _Reads) -> None:
    fault = _safe(fault_record, store, peer.rank, reads)
    if fault is not None:
        peer.fault, peer.record = fault, fault
        peer.state = "comm" if fault.get("comm") else "failed"
        return
    record = _safe(read_record, store, peer.rank, reads)
    if record is not None and (peer.first is None or record.get("beat") != peer.first.get("beat")):
        peer.state, peer.record = "alive", record


def _safe(read: Any, store: Any, rank: int, reads: _Reads) -> Optional[dict[str, Any]]:
    try:
        result: Optional[dict[str, Any]] = read(store, rank)
    except StoreRecordError:
        raise  # a forged record: named, not taken for an unreachable store
    except Exception as exc:  # noqa: BLE001 - an unreachable store says nothing about this peer, but of its host
        reads.error = reads.error or short_cause(exc)
        return None
    reads.ok += 1
    return result


# ------------------------------------------------------------------ message
def _position(peer: _Peer, key: str) -> dict[str, Any]:
    record = peer.record or {}
    groups: dict[str, Any] = record.get("groups", {})
    position: dict[str, Any] = groups.get(key, {})
    return position


def _where(peer: _Peer, key: str) -> str:
    record = peer.record or {}
    position = _position(peer, key)
    doing = record.get("doing", "an unknown place")
    if peer.state == "failed":
        return f"raised `{record.get('error')}` in {doing}"
    if peer.state == "gone":
        last = position.get("waiting") or position.get("last")
        seen = f"waiting on {last}" if position.get("waiting") else f"in {doing}" + (
            f" (its last collective on this group: {last})" if last else "")
        if peer.first is None:
            return "gone: it never wrote a heartbeat (it died before its first collective, or never started one)"
        age = float(record.get("interval", 0.0))
        return (f"gone: its heartbeat stopped (watched {peer.watched:.1f} s); its last heartbeat (at most "
                f"{age:g} s before it stopped) had it {seen}")
    if position.get("waiting"):
        line = f"waiting on {position['waiting']} for {position.get('waited', 0):.1f} s"
    else:
        last = position.get("last")
        line = f"busy in {doing}, in no collective of this group" + (f" (its last: {last})" if last else "")
    if peer.state == "comm":
        line += f"; it saw its own collective fail: {record.get('error')}"
    return line


def _compose(failure: Failure, peers: list[_Peer]) -> CommError:
    key = failure.ledger.key
    me = failure.rank
    where = {me: failure.operation}
    where.update({p.rank: _where(p, key) for p in peers})
    gone = [p.rank for p in peers if p.state == "gone"]
    failed = {p.rank: str((p.record or {}).get("error")) for p in peers if p.state == "failed"}
    facts = dict(rank=me, where=where, gone=gone, failed=failed)
    tail = _tail(failure, where)
    if failed:
        head = (f"rank {me}: rank(s) {sorted(failed)} raised an error of their own (below), so the collective "
                "this rank waits on cannot complete; fix that error (the failing rank's log has its traceback)")
        return PeerFailedError(head + tail, **facts)  # type: ignore[arg-type]
    if gone:
        head = (f"rank {me}: rank(s) {gone} are gone (killed, crashed or exited) while this rank was "
                f"{failure.operation}; {RESTART}")
        return RankGoneError(head + tail, **facts)  # type: ignore[arg-type]
    if _disagree(failure, peers, key):
        head = f"rank {me}: the ranks are in different collectives; {AGREE}"
        return CollectiveMismatchError(head + tail, **facts)  # type: ignore[arg-type]
    echoes = [p.rank for p in peers if p.state == "comm"]
    if echoes:
        head = (f"rank {me}: rank(s) {echoes} gave up on their collective first (below) while this rank was "
                f"{failure.operation}; look for the first error in their logs")
        return CommError(head + tail, **facts)  # type: ignore[arg-type]
    head = (f"rank {me}: a collective did not complete within `comms.timeout` = {failure.timeout:g} s while "
            f"this rank was {failure.operation}, although every rank is alive; if a rank is only slow (a long "
            "evaluation or data loading on one rank), raise `comms.timeout`")
    return CommError(head + tail, **facts)  # type: ignore[arg-type]


def _tail(failure: Failure, where: dict[int, str]) -> str:
    """Where each rank was, and the backend's words."""
    me = failure.rank
    lines = "\n".join(f"  rank {r}: {text}" + (" (this rank)" if r == me else "") for r, text in sorted(where.items()))
    return f"\nWhere each rank of process group {failure.ledger.key} was:\n{lines}\nThe backend said: {failure.cause}"


def _store_lost(failure: Failure, peers: list[_Peer], host: StoreHost, cause: str) -> CommError:
    """No record could be read: the store is gone, and with it the process that hosted it."""
    me, store = failure.rank, host.describe()
    where = {me: failure.operation}
    for peer in peers:
        where[peer.rank] = (f"gone: the c10d store it hosted at {host.address} cannot be reached ({cause})"
                            if peer.rank == host.rank
                            else "not known: its heartbeat is kept in the store that cannot be reached")
    gone = [p.rank for p in peers if p.rank == host.rank]
    facts = dict(rank=me, where=where, gone=gone, failed={})
    lost = f"rank {host.rank} is gone (killed, crashed or exited), and with it " if host.rank is not None else ""
    head = (f"rank {me}: {lost}{store}: the store cannot be reached ({cause}) while this rank was "
            f"{failure.operation}; {RESTART}")
    error = RankGoneError if gone else CommError
    return error(head + _tail(failure, where), **facts)  # type: ignore[arg-type]


def _disagree(failure: Failure, peers: list[_Peer], key: str) -> bool:
    """Whether some alive peer waits on another collective than this rank (or on one while this rank checks),
    or gave up elsewhere: outside any collective of the group, having never issued (or gone past) this one."""
    for peer in peers:
        position = _position(peer, key)
        waiting = position.get("waiting")
        if waiting is None:
            last = position.get("last")
            if peer.state == "comm" and failure.seq and last is not None and not str(last).startswith(f"#{failure.seq} "):
                return True
            continue
        if failure.seq == 0 or not str(waiting).startswith(f"#{failure.seq} "):
            return True
        if str(waiting) != failure.operation.removeprefix("waiting on "):
            return True
    return False
