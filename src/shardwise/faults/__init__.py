"""Faults across ranks: no collective waits forever, and every failure names the ranks involved.

What is always on (measured in ``docs/faults.md``):

* every collective shardwise issues has ``comms.timeout`` as its own backend
  timeout and is recorded in its group's ledger (:mod:`.ledger`);
* a heartbeat thread per process writes, a few times a minute, what the
  process is doing into the c10d store (:mod:`.heartbeat`);
* once per optimizer step the engine compares the ranks' collective
  sequences over a small control group (:mod:`.control`);
* every collective operation (``full_state_dict``, a stage-3 forward, a
  reducing backward, a save...) first announces itself over that group, so
  ranks in different operations raise before any data moves (:mod:`.announce`);
* every wait reads, between short slices, the errors the other ranks
  published: a rank that raised and will not come is named at once
  (:mod:`.published`).

When a collective fails, :func:`diagnose` reads the other ranks' records and
raises one of the errors below, naming the rank that is gone, failed or
elsewhere, and the operation each was in.  ``comms.debug: true`` adds a check
before every collective.
"""

from __future__ import annotations

from typing import Optional

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


def last_error() -> Optional[str]:
    """The error this process published last (None: none, or withdrawn once its ranks agreed on an operation)."""
    return _heartbeat.published()
