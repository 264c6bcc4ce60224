"""Faults across ranks: no collective waits forever, and every failure names the ranks involved.

Always on (measured in docs/faults.md): ``comms.timeout`` as every collective's backend timeout and a ledger
per group (:mod:`.ledger`), a heartbeat thread per process (:mod:`.heartbeat`), a step check over a small
control group (:mod:`.control`), an announcement before every collective operation (:mod:`.announce`), and
waits that read the errors other ranks published (:mod:`.published`).  When a collective fails, :func:`diagnose`
raises one of the errors below naming the rank that is gone, failed or elsewhere.
"""

from __future__ import annotations

import torch.distributed as dist

from . import heartbeat as _heartbeat
from .diagnose import Failure, diagnose, short_cause
from .errors import CollectiveMismatchError, CommError, PeerFailedError, RankGoneError
from .ledger import current_activity, doing

__all__ = [
    "CollectiveMismatchError",
    "CommError",
    "Failure",
    "PeerFailedError",
    "RankGoneError",
    "current_activity",
    "diagnose",
    "doing",
    "short_cause",
    "watch",
]

_MAX_ERROR_CHARS = 500


def watch(rank: int, timeout: float) -> None:
    """Start (or speed up) this process's heartbeat and publish errors leaving engine calls (withdrawn once
    the ranks agree on an operation again, :mod:`.control`)."""
    store = dist.distributed_c10d._get_default_store()
    _heartbeat.start(store, rank, timeout)
    doing.on_error = _publish_error


def _publish_error(exc: BaseException, where: str) -> None:
    if isinstance(exc, CommError):
        return  # already published, with where each rank was
    text = f"{type(exc).__name__}: {exc}"
    _heartbeat.publish_fault(text[:_MAX_ERROR_CHARS], comm=False, doing=where)

