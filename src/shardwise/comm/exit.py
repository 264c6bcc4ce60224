"""Leave the process cleanly after training: settle gloo's worker threads before Python finalizes.

Why this exists.  gloo runs every collective on a worker thread of its process
group, and that thread drops its own reference to the collective (and so to
its tensors) only after the collective finished.  When that is the last
reference to a tensor Python also knew, dropping it needs the GIL.  Once the
interpreter has begun to finalize, a foreign thread that asks for the GIL is
ended with ``pthread_exit``, whose unwinding through gloo's C++ frames calls
``std::terminate``: the process dies with SIGABRT ("terminate called without
an active exception") after the script has finished and printed its results.
Seen with ZeRO-3 engines, whose units gather right up to the last forward:
about one run in 40 of ``examples/gan.py`` under ``torchrun`` on a loaded
2-core machine (a core dump showed a gloo worker destroying an all-gather
inside ``Py_FinalizeEx``'s collection).

What it does, at ``atexit`` (before finalization, while every thread can
still take the GIL): wait for the collectives shardwise started and nobody
waited for, bounded by a few seconds (a dead peer must not hold the exit),
then run one garbage collection.  Engines are reference cycles (modules and
their hooks), so that collection frees their buffers, and, when the script has
already called ``destroy_process_group``, their process groups too, whose
destructors join the worker threads.  Nothing here raises: exit must not fail.
"""

from __future__ import annotations

import atexit
import gc
from datetime import timedelta
from typing import Any

__all__ = ["track"]

#: how long exit waits for one unwaited collective (seconds)
_WAIT_S = 5.0
#: at most this many unwaited collectives are remembered (the oldest are long finished)
_MAX_TRACKED = 1024

# Keyed by id(): a collective is forgotten when its waiter returns.  Work.is_completed()
# cannot prune this: gloo's reduce-scatter reports False even after a successful wait.
_UNWAITED: dict[int, Any] = {}


def track(work: Any) -> None:
    """Remember an asynchronous collective until it is waited for (called by ``Comm``)."""
    _UNWAITED[id(work)] = work
    if len(_UNWAITED) > _MAX_TRACKED:
        del _UNWAITED[next(iter(_UNWAITED))]


def forget(work: Any) -> None:
    """The collective was waited for: exit need not."""
    _UNWAITED.pop(id(work), None)


def _settle() -> None:
    for work in list(_UNWAITED.values()):
        try:
            work.wait(timedelta(seconds=_WAIT_S))
        except Exception:  # a peer died or the group is gone: exit anyway
            pass
    _UNWAITED.clear()
    gc.collect()


atexit.register(_settle)
