"""While a rank waits on others through the c10d store, tell which of them stopped beating.

Store polls (the checkpoint layer's steps) get no backend error when a peer dies: :class:`PeerWatch` reads the
peers' heartbeat records (every half interval at most) and reports a peer whose beat stood still for 2.5 of its
intervals; a rank that never beat is left to the caller's own timeout.  A store that fails every read for as
long is reported as its host gone (:func:`store_host`: the store died with the process that served it, rank 0
for ``env://`` and ``tcp://`` rendezvous, or torchrun's agent when ``TORCHELASTIC_USE_AGENT_STORE=True``; a
file store has no host).  :meth:`PeerWatch.failed` names a peer that raised and will not come (:mod:`.published`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch.distributed as dist

from .errors import StoreRecordError
from .heartbeat import heartbeat, innermost, read_record
from .published import SLICE_S, PeerErrors

__all__ = ["PeerWatch", "StoreHost", "store_host"]


@dataclass(frozen=True)
class StoreHost:
    """Where a store lives: its address, and the global rank whose process serves it (None: no rank's)."""

    address: str
    rank: Optional[int]

    def describe(self) -> str:
        """The store and its host, in words."""
        if self.rank is not None:
            return f"the c10d store at {self.address} (hosted by rank {self.rank})"
        return f"the c10d store at {self.address} (hosted by torchrun's agent, or the process that created it)"


def store_host(store: Any) -> Optional[StoreHost]:
    """Who hosts ``store`` (None for a store without a server, such as a file store)."""
    base = innermost(store)
    if not isinstance(base, dist.TCPStore):
        return None
    address = f"{base.host}:{base.port}"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return StoreHost(address, None)
    return StoreHost(address, 0)  # env:// and tcp:// rendezvous: rank 0 serves it (`is_master`)


class PeerWatch:
    """Watches global ranks' heartbeats; :meth:`gone` lists those that stopped."""

    def __init__(self) -> None:
        beat = heartbeat()
        self.store: Optional[Any] = beat.store if beat is not None else None
        self.interval = beat.interval if beat is not None else 1.0
        self._seen: dict[int, tuple[Any, float, float]] = {}  # rank -> (beat, since when unchanged, its interval)
        self._next = 0.0
        #: since when every read of the store failed (None: the last one worked)
        self._unreachable_since: Optional[float] = None
        #: the last record read of each rank (what it was doing when it stopped)
        self.records: dict[int, dict[str, Any]] = {}
        self._errors: Optional[PeerErrors] = None
        self._next_errors = 0.0

    def failed(self, ranks: Iterable[int]) -> Optional[tuple[int, str]]:
        """A peer among ``ranks`` whose published error means it will not come: its rank and the error in words
        (None: none; read every :data:`~.published.SLICE_S` seconds at most)."""
        now = time.monotonic()
        if self.store is None or now < self._next_errors:
            return None
        self._next_errors = now + SLICE_S
        peers = sorted(set(ranks))
        if self._errors is None or self._errors.peers != peers:
            self._errors = PeerErrors(self.store, peers)
        try:
            return self._errors.find()
        except Exception:  # noqa: BLE001 - an unreachable store: `gone` names its host
            return None

    def gone(self, ranks: Iterable[int]) -> list[int]:
        """The ranks among ``ranks`` whose heartbeat stood still long enough to call them gone."""
        now = time.monotonic()
        if self.store is None or now < self._next:
            return []
        self._next = now + self.interval / 2
        stopped: list[int] = []
        answered = False
        ranks = list(ranks)
        for rank in ranks:
            try:
                record = read_record(self.store, rank)
            except StoreRecordError:
                raise  # a forged record: named at once, not taken for an unreachable store
            except Exception:  # noqa: BLE001 - an unreachable store says nothing about this peer, but of its host
                continue
            answered = True
            if record is None:
                continue
            self.records[rank] = record
            beat, interval = record.get("beat"), float(record.get("interval", self.interval))
            seen = self._seen.get(rank)
            if seen is None or seen[0] != beat:
                self._seen[rank] = (beat, now, interval)
            elif now - seen[1] > 2.5 * interval + 0.2:
                stopped.append(rank)
        return stopped or self._store_host_gone(ranks, answered, now)

    def _store_host_gone(self, ranks: list[int], answered: bool, now: float) -> list[int]:
        """``[host]`` once the store has failed every read for 2.5 intervals and its host is among ``ranks``."""
        if answered or not ranks:
            self._unreachable_since = None
            return []
        if self._unreachable_since is None:
            self._unreachable_since = now
        host = store_host(self.store)
        if host is None or host.rank not in ranks or now - self._unreachable_since <= 2.5 * self.interval + 0.2:
            return []
        return [host.rank]

    def last_seen(self, rank: int) -> str:
        """What ``rank``'s last heartbeat said it was doing."""
        record = self.records.get(rank, {})
        return str(record.get("doing", "an unknown place"))
