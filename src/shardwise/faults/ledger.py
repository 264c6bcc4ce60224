"""What this process is doing, kept cheaply enough to stay on in every run.

Two records, plain Python objects written on the training thread: the **activity** (the engine call running
now, pushed and popped by :class:`doing`) and one **ledger** per process group (every collective issued on it
gets a sequence number, joins a rolling fingerprint, and goes into a log of the last :data:`LOG_LENGTH`, with
the activity it was issued in).  :class:`~shardwise.comm.distributed.Comm` records each collective as it issues
it (in its own file: this one is not on a gradient's path); descriptions are formatted only when something went
wrong.  The step check compares the fingerprint (:mod:`.control`), an error shows the log.
"""

from __future__ import annotations

import collections
import time
import weakref
from typing import Any, Callable, NamedTuple, Optional

import torch

__all__ = ["ACTIVITY", "IDLE", "Entry", "Ledger", "LOG_LENGTH", "current_activity", "current_phase", "doing", "failed",
           "innermost", "ledger_for", "ledgers", "start"]

#: how many recent collectives each ledger keeps for error messages
LOG_LENGTH = 64


class Entry(NamedTuple):
    """One collective this rank issued: its place in the group's sequence and what it was for (a record
    :class:`~shardwise.comm.distributed.Comm` makes as it issues the collective)."""

    seq: int
    kind: str
    numel: int
    dtype: torch.dtype
    label: str
    #: the engine call it was issued in, as messages name it
    activity: str
    #: ``time.monotonic()`` when it was issued
    issued: float

    def describe(self) -> str:
        """``#12 all_gather of 4096 float32 (unit 3 `blocks.0.weight`, ...) in `forward` of engine ...``."""
        dtype = str(self.dtype).replace("torch.", "")
        what = f" ({self.label})" if self.label else ""
        return f"#{self.seq} {self.kind} of {self.numel} {dtype}{what} in {self.activity}"


# ------------------------------------------------------------------ activity
#: the engine calls running now, innermost last: pushed and popped by :class:`doing` (the engine's own calls on
#: every gradient's path, ``backward`` and ``step``, push and pop theirs in place, see ``Engine._running``)
ACTIVITY: list["doing"] = []
#: what an entry names as its activity outside every engine call
IDLE = "no engine call (between `engine` calls)"


def current_activity() -> str:
    """The innermost engine call running now, as messages name it."""
    return ACTIVITY[-1].text if ACTIVITY else IDLE


def current_phase() -> Optional[str]:
    """The innermost engine call's name (``generate``), None between engine calls."""
    return ACTIVITY[-1].phase if ACTIVITY else None


def innermost() -> Optional["doing"]:
    """The innermost engine call running now (None between engine calls)."""
    return ACTIVITY[-1] if ACTIVITY else None


def start(call: Optional["doing"] = None) -> None:
    """Engine call ``call`` (default: the innermost) has started changing state (its ranks agreed on it): a
    failure from now on counts in :attr:`doing.failures` (an argument refused before this point does not)."""
    call = call if call is not None else innermost()
    if call is not None:
        call.started = True


class doing:  # noqa: N801 - used as a context manager, reads like one
    """``with doing("backward", engine.label):`` marks what this process does until the block ends.

    An exception leaving the block is published for the other ranks, once however many blocks it leaves.  When the
    call had :func:`start` ed (its ranks agreed on it; an argument refused before that changes nothing), it also counts
    in :attr:`failures`, which every announcement and step check compares (:mod:`.control`): a failure on some ranks
    only is never followed by a silent pairing of their next collectives.  A class, not a generator: it runs three
    times per training step.
    """

    __slots__ = ("phase", "text", "started")
    on_error: Optional[Callable[[BaseException, str], None]] = None
    #: engine calls that raised after they started, in this process
    failures = 0

    def __init__(self, phase: str, owner: str) -> None:
        self.phase = phase
        self.text = f"`{phase}` of {owner}"
        self.started = False

    def __enter__(self) -> "doing":
        ACTIVITY.append(self)
        return self

    def __exit__(self, kind: Any, exc: Optional[BaseException], tb: Any) -> None:
        if ACTIVITY and ACTIVITY[-1] is self:
            ACTIVITY.pop()
        if exc is not None:
            failed(self, exc)


def failed(call: doing, exc: BaseException) -> None:
    """``exc`` leaves engine call ``call`` (popped already): counted once if the call had started, and published
    for the other ranks once, however many calls it leaves."""
    # marks on the exception itself (not a reference to it here: it holds its frames, and their tensors)
    if call.started and not _marked(exc, "_shardwise_counted"):
        doing.failures += 1
    if doing.on_error is not None and not _marked(exc, "_shardwise_published"):
        doing.on_error(exc, call.text)


def _marked(exc: BaseException, mark: str) -> bool:
    """Whether ``exc`` carries ``mark`` already; sets it."""
    if getattr(exc, mark, False):
        return True
    try:
        setattr(exc, mark, True)
    except AttributeError:  # an exception type without attributes: counted (and published) at each block
        pass
    return False


# -------------------------------------------------------------------- ledger
class Ledger:
    """The collectives issued on one process group, as this rank issued them."""

    def __init__(self, key: str, ranks: list[int]) -> None:
        #: the group's name and members, as error messages and store keys use it
        self.key = key
        #: global ranks of the group, in group-rank order
        self.ranks = ranks
        self.seq = 0
        self.fingerprint = 0
        #: the last :data:`LOG_LENGTH` collectives, oldest first (``Comm`` appends each as it issues it, with ``seq``
        #: and ``fingerprint`` moved on: :mod:`shardwise.comm.distributed`)
        self.log: collections.deque[Entry] = collections.deque(maxlen=LOG_LENGTH)
        self.last: Optional[Entry] = None
        #: the collective a ``wait()`` is blocked on right now (None: not waiting)
        self.waiting: Optional[Entry] = None
        #: set by the first failure: every later collective on the group raises it again
        self.broken: Optional[BaseException] = None
        #: the control group used by the step check and ``comms.debug`` (made on first use)
        self.control: Any = None
        #: the announced operation running on this group now (None: none); announcements nested in it are skipped
        self.scope: Any = None
        #: engines built on this group so far (an engine's index names it in announcements)
        self.engines = 0
        #: what this rank's waits read of the errors other ranks published (made on first use)
        self.peer_errors: Any = None

    def status(self) -> dict[str, Any]:
        """This group's position, for the heartbeat record (read from another thread: no iteration)."""
        last, waiting = self.last, self.waiting
        return {
            "seq": self.seq,
            "last": last.describe() if last is not None else None,
            "waiting": waiting.describe() if waiting is not None else None,
            "waited": round(time.monotonic() - waiting.issued, 3) if waiting is not None else 0.0,
        }


_LEDGERS: dict[str, tuple[Ledger, Any]] = {}


def ledger_for(key: str, ranks: list[int], group: Any) -> Ledger:
    """The one ledger of process group ``group``, named ``key`` (several ``Comm`` objects may share a group;
    a group of the same name made after ``destroy_process_group`` gets a fresh ledger)."""
    known = _LEDGERS.get(key)
    if known is not None and known[1]() is group:
        return known[0]
    ledger = Ledger(key, ranks)
    _LEDGERS[key] = (ledger, weakref.ref(group))
    return ledger


def ledgers() -> list[Ledger]:
    """Every ledger of this process."""
    return [ledger for ledger, _ in list(_LEDGERS.values())]
