"""Making sure every rank takes part in a collective call, without the training group.

Used by the checkpoint layer and by the engines' construction (:mod:`.construction`).  Before a collective call
issues anything on the process group, the ranks meet through the c10d store, never a collective (one could pair
with the gradient all-reduce of a rank that skipped the call); the protocol, with no state kept in the process, is in
docs/checkpoints.md.  Once they met, :func:`join` announces the operation (:meth:`~.faults.announce.Scope.agreed`); a
call whose missing ranks all wait in an announcement of their own (:func:`~.faults.control.waiting_in_next`) is closed
as ``elsewhere`` and announced at once, naming both operations within seconds.  :meth:`Session.step` then gives
bounded, error-propagating steps between phases.

Values cross the store as JSON (:mod:`.checkpoint.store_codec`, never a pickle), at most ``MAX_STORE_VALUE_BYTES``
long.  Every wait watches the heartbeats (:class:`~shardwise.faults.liveness.PeerWatch`): a dead rank is named within
a few heartbeat intervals, not at ``checkpoint.timeout``.
"""

from __future__ import annotations

import json
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch.distributed as dist

from ..checkpoint import store_codec
from ..checkpoint.files import CheckpointError
from ..faults import control
from ..faults.diagnose import RESTART, short_cause
from ..faults.errors import PeerFailedError, RankGoneError
from ..faults.liveness import PeerWatch, store_host
from .distributed import Comm, group_key

__all__ = ["Session", "join"]

_ROOT = "shardwise/checkpoint"
_CLOSED = "closed:"
#: after ``closed:``: closed because the ranks missing wait in other operations' announcements
_ELSEWHERE = "elsewhere:"
#: seconds between two looks at whether the missing ranks wait in announcements (a few store reads each)
_LOOK_S = 0.05
_MEMBERS = re.compile(r"(?:[0-9]{1,7}(?:,[0-9]{1,7})*)?")
_T = TypeVar("_T")


def _members(value: str, key: str, rank: int, world_size: int) -> set[int]:
    if not _MEMBERS.fullmatch(value):
        raise store_codec.malformed(key, rank, f"holds {value!r:.80}, expected a comma-separated list of ranks")
    members = {int(r) for r in value.split(",") if r}
    if any(r >= world_size for r in members):
        raise store_codec.malformed(key, rank, f"holds {value!r:.80}, which lists ranks beyond the group's "
                                               f"{world_size}")
    return members


def _sleep(attempt: int) -> None:
    time.sleep(min(0.002 * (attempt + 1), 0.05))


@dataclass
class Session:
    """One checkpoint call that every rank has joined; ``payloads[r]`` is what rank ``r`` passed."""

    op: str
    rank: int
    world_size: int
    timeout: float
    payloads: list[dict[str, Any]]
    store: Any = None
    prefix: str = ""
    #: the global rank of each group rank (heartbeats are per global rank)
    global_ranks: list[int] = field(default_factory=list)
    _steps: int = field(default=0)

    def require_same(self, key: str, what: str, fix: str) -> Any:
        """The value of ``key`` every rank passed; raises on every rank if they differ."""
        values = [p.get(key) for p in self.payloads]
        if any(v != values[0] for v in values):
            listed = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise CheckpointError(
                f"rank {self.rank}: the ranks called `{self.op}` with different {what} ({listed}); "
                f"`{self.op}` is collective and every rank must pass the same one: {fix}"
            )
        return values[0]

    def step(self, name: str, fn: Callable[[], _T], share: bool = False, objects: Any = None) -> tuple[_T, list[Any]]:
        """Run ``fn`` here, then wait for every rank's outcome of the same step.

        Returns ``fn``'s result and, with ``share``, every rank's result (which must then be JSON-able; else a list
        of None).  ``objects`` is the type of every rank's result (e.g. ``list[SavePlan]``) when it holds DCP's save
        plans or write results: those cross the store through :mod:`.checkpoint.store_codec`, and a rank's value of
        another type is a :class:`~.checkpoint.files.StoreValueError`.  If ``fn`` raised on any rank, every rank
        raises: the failing rank its own error, the others a :class:`CheckpointError` naming it.
        """
        error: Optional[BaseException] = None
        data: Any = None
        try:
            data = fn()
        except Exception as exc:  # noqa: BLE001 - reported to the other ranks, then re-raised
            error = exc
        if self.world_size == 1:
            if error is not None:
                raise error
            return data, [data if share or objects is not None else None]
        text = "null"
        if error is None and (share or objects is not None):
            try:
                text = store_codec.dumps(data, tagged=objects is not None)
            except (TypeError, ValueError) as exc:
                error = CheckpointError(f"rank {self.rank}: cannot pass its result of {name} for `{self.op}` to the "
                                        f"other ranks: {exc}")
        with _reachable(self.store, self.rank, self.op, f"waiting for every rank to finish {name}"):
            results = self._exchange(name, text, error)
        if error is not None:
            raise error
        failed = [(r, res["error"]) for r, res in enumerate(results) if res["error"] is not None]
        if failed:
            detail = "; ".join(f"rank {r}: {message}" for r, message in failed)
            raise CheckpointError(
                f"rank {self.rank}: `{self.op}` failed on rank(s) {[r for r, _ in failed]} while {name}: {detail}"
            )
        if objects is None:
            return data, [res["data"] for res in results]
        return data, [store_codec.restore(res["data"], res["key"], self.rank, objects) for res in results]

    def _exchange(self, name: str, text: str, error: Optional[BaseException]) -> list[dict[str, Any]]:
        self._steps += 1
        keys = [f"{self.prefix}/step{self._steps}/{r}" for r in range(self.world_size)]
        message = None if error is None else f"{type(error).__name__}: {error}"
        # `text` is already JSON (and within the bound): spliced in, not serialised twice
        self.store.set(keys[self.rank], f'{{"error":{json.dumps(message)},"data":{text if error is None else "null"}}}')
        deadline = time.monotonic() + self.timeout
        watch = PeerWatch()
        attempt = 0
        while not self.store.check(keys):
            missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
            try:
                self._raise_if_gone(watch, missing, name)
            except PeerFailedError:
                # A step that fails writes its outcome here, then raises and publishes: a peer seen failed after
                # `missing` was read may have written its outcome meanwhile, and that names it as this step's
                if self.store.check(keys):
                    break
                raise
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"rank {self.rank}: rank(s) {missing} did not finish {name} for `{self.op}` within "
                    f"`checkpoint.timeout` = {self.timeout:g} s; they are stuck (their logs say where); raise "
                    "`checkpoint.timeout` if they are only slow"
                )
            _sleep(attempt)
            attempt += 1
        return [_outcome(self.store.get(key), key, self.rank) for key in keys]

    def _raise_if_gone(self, watch: PeerWatch, missing: list[int], name: str) -> None:
        """Raise when a rank this step waits for stopped beating (killed, crashed, exited), or raised."""
        if not self.global_ranks:
            return
        _raise_if_failed(watch, [self.global_ranks[r] for r in missing], self.rank, f"{name} for `{self.op}`")
        gone = watch.gone(self.global_ranks[r] for r in missing)
        if gone:
            raise _gone(self.rank, gone, watch, f" while this rank waited for them to finish {name} for `{self.op}`",
                        ". The previous checkpoint and `latest` are untouched (a save is visible only once every rank "
                        "finished)" if self.op.startswith("save") else "")


def join(comm: Comm, op: str, payload: dict[str, Any], timeout: float) -> Session:
    """Wait (at most ``timeout`` seconds) until every rank of ``comm`` calls ``op``; see the module doc.

    Inside an operation whose announcement waits for this agreement (``after_agreement``), announces it."""
    if not comm.distributed:
        return Session(op, comm.rank, 1, timeout, [payload])
    scope = comm.ledger.scope
    announces = scope if scope is not None and scope.deferred else None
    store = dist.distributed_c10d._get_default_store()
    with _reachable(store, comm.rank, op, "waiting for every rank to call it"):
        try:
            prefix = _enter(store, comm, op, payload, timeout, announces is not None)
        except _Elsewhere as away:
            if announces is not None:
                announces.agreed()  # raises on every rank, naming what each is in
            raise _not_joined(comm, op, timeout, away.present) from None
        payloads = [_payload(store, prefix, r, comm.rank) for r in range(comm.world_size)]
    if announces is not None:
        announces.agreed()
    return Session(op, comm.rank, comm.world_size, timeout, payloads, store, prefix, comm.ledger.ranks)


class _Elsewhere(Exception):
    """The call was closed because the ranks missing wait in other operations' announcements."""

    def __init__(self, present: set[int]) -> None:
        super().__init__()
        self.present = present


def _enter(store: Any, comm: Comm, op: str, payload: dict[str, Any], timeout: float, look: bool) -> str:
    """Join the next call every rank makes, and wait until they all have; returns the call's key prefix.
    ``look``: also look whether the ranks missing wait in announcements (:class:`_Elsewhere`)."""
    root = f"{_ROOT}/{group_key(comm.group)}"
    deadline = time.monotonic() + timeout
    while True:
        call = store.add(f"{root}/next/{comm.rank}", 1)
        prefix = f"{root}/{call}"
        store.set(f"{prefix}/payload/{comm.rank}", json.dumps(payload))
        if _arrive(store, f"{prefix}/members", comm.rank, comm.world_size):
            break
        # That call was closed before we got there: our partners moved on to a later one.
    _await_everyone(store, f"{prefix}/members", comm, op, timeout, deadline, look)
    return prefix


@contextmanager
def _reachable(store: Any, rank: int, op: str, doing: str) -> Iterator[None]:
    """A store that stops answering (its host exited or died) is named, with its host, as a gone rank."""
    try:
        yield
    except dist.DistNetworkError as exc:
        host = store_host(store)
        gone = [host.rank] if host is not None and host.rank is not None else []
        where = host.describe() if host is not None else "the c10d store"
        who = f"rank {gone[0]} exited or died, and the store with it" if gone else "the store's host exited or died"
        raise RankGoneError(
            f"rank {rank}: {where} cannot be reached ({short_cause(exc)}) while this rank was {doing} for `{op}`: "
            f"{who}; {RESTART}", rank=rank, gone=gone) from None


def _outcome(raw: Any, key: str, rank: int) -> dict[str, Any]:
    """One rank's outcome of a step, as it wrote it: ``{"error": text or null, "data": ...}`` (+ its key)."""
    value = store_codec.loads(raw, key, rank, tagged=False)
    if not (isinstance(value, dict) and set(value) == {"error", "data"} and isinstance(value["error"], (str, type(None)))):
        raise store_codec.malformed(key, rank, f"holds {str(value):.80}, expected {{\"error\": text or null, \"data\": ...}}")
    return {**value, "key": key}


def _payload(store: Any, prefix: str, member: int, rank: int) -> dict[str, Any]:
    """What ``member`` passed to the call; it wrote that before it added itself to the member list."""
    key = f"{prefix}/payload/{member}"
    if not store.check([key]):  # never `get` a key that may not come: it would wait for the store's own timeout
        raise store_codec.malformed(
            f"{prefix}/members", rank, f"lists rank {member}, whose payload `{key}` is not in the store (a rank "
            "writes its payload before it adds itself to the list)")
    value = store_codec.loads(store.get(key), key, rank, tagged=False)
    if not isinstance(value, dict):
        raise store_codec.malformed(key, rank, f"holds {str(value):.80}, expected a JSON object (a call's payload)")
    return value


def _arrive(store: Any, key: str, rank: int, world_size: int) -> bool:
    """Add ``rank`` to the member list; False when the call is already closed."""
    current = ""
    while True:
        if current.startswith(_CLOSED):
            return False
        wanted = ",".join(str(r) for r in sorted(_members(current, key, rank, world_size) | {rank}))
        got = store.compare_set(key, current, wanted).decode(errors="replace")
        if got == wanted:
            return True
        current = got


def _await_everyone(store: Any, key: str, comm: Comm, op: str, timeout: float, deadline: float,
                    look: bool) -> None:
    watch, ranks = PeerWatch(), comm.ledger.ranks
    attempt = 0
    looked = time.monotonic()
    while True:
        if not store.check([key]):  # this rank wrote it: only another program can have deleted it
            raise store_codec.malformed(key, comm.rank, "was deleted while this rank waited on it")
        value = store.get(key).decode(errors="replace")
        if value.startswith(_CLOSED):
            _closed(value[len(_CLOSED) :], key, comm, op, timeout)
        present = _members(value, key, comm.rank, comm.world_size)
        if len(present) == comm.world_size:
            return
        missing = [ranks[r] for r in range(comm.world_size) if r not in present]
        _raise_if_failed(watch, missing, comm.rank, f"`engine.{op}`")
        gone = watch.gone(missing)
        away = False
        if look and not gone and time.monotonic() - looked > _LOOK_S:
            looked = time.monotonic()
            away = control.waiting_in_next(comm.ledger, comm.global_rank, missing)
        if gone or away or time.monotonic() > deadline:
            closed = _CLOSED + (_ELSEWHERE if away else "") + value
            if store.compare_set(key, value, closed).decode() == closed:
                if gone:
                    raise _gone(comm.rank, gone, watch, f", so `engine.{op}` cannot start")
                if away:
                    raise _Elsewhere(present)
                raise _not_joined(comm, op, timeout, present)
            continue  # someone joined or closed meanwhile: look again
        _sleep(attempt)
        attempt += 1


def _closed(value: str, key: str, comm: Comm, op: str, timeout: float) -> None:
    """Another member closed the call (``value``: the member list after ``closed:``): raise as it did."""
    away = value.startswith(_ELSEWHERE)
    present = _members(value[len(_ELSEWHERE) :] if away else value, key, comm.rank, comm.world_size)
    raise _Elsewhere(present) if away else _not_joined(comm, op, timeout, present)


def _raise_if_failed(watch: PeerWatch, ranks: list[int], rank: int, what: str) -> None:
    """Raise when a rank waited for published an error that means it will not come (it raised in an engine call
    that this rank went through, and is alive elsewhere)."""
    found = watch.failed(ranks)
    if found is not None:
        peer, error = found
        raise PeerFailedError(
            f"rank {rank}: {error}, while this rank waited for it in {what}; fix that error (the failing rank's log "
            "has its traceback)", rank=rank, failed={peer: error})


def _gone(rank: int, gone: list[int], watch: PeerWatch, when: str, tail: str = "") -> RankGoneError:
    seen = "; ".join(f"rank {r} was last seen in {watch.last_seen(r)}" for r in gone)
    return RankGoneError(f"rank {rank}: rank(s) {gone} are gone (killed, crashed or exited){when} ({seen}); "
                         f"{RESTART}{tail}", rank=rank, gone=gone, where={r: watch.last_seen(r) for r in gone})


def _not_joined(comm: Comm, op: str, timeout: float, present: set[int]) -> CheckpointError:
    missing = sorted(set(range(comm.world_size)) - present)
    return CheckpointError(
        f"rank {comm.rank}: `engine.{op}` is collective: every rank of the process group must call it, "
        f"with the same tag, but rank(s) {missing} did not call it within `checkpoint.timeout` = {timeout:g} s "
        f"(rank(s) {sorted(present)} did). Call `engine.{op}(...)` on every rank, not under "
        "`if rank == 0:`; if some ranks only arrive late, raise `checkpoint.timeout`."
    )
