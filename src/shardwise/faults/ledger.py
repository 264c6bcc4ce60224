"""What this process is doing, kept cheaply enough to stay on in every run.

Two records, both plain Python objects written on the training thread:

* the **activity**: the engine call running now (``backward`` of
  ``engine (stage 2, Net)``), pushed and popped by :func:`doing`;
* one **ledger** per process group: every collective issued on it gets a
  sequence number, joins a rolling fingerprint of the group's collective
  sequence, and goes into a short log (the last :data:`LOG_LENGTH` entries),
  with the activity it was issued in.

Recording a collective costs a dictionary lookup, a multiply-xor and a deque
append; descriptions are only formatted when something went wrong (or by the
heartbeat thread, a few times a minute).  The fingerprint is what the step
check compares across ranks (:mod:`.control`), the log is what an error shows.
"""

from __future__ import annotations

import collections
import time
import weakref
import zlib
from typing import Any, Callable, Optional

import torch

__all__ = ["Entry", "Ledger", "LOG_LENGTH", "current_activity", "current_phase", "doing", "innermost", "ledger_for",
           "ledgers", "start"]

#: how many recent collectives each ledger keeps for error messages
LOG_LENGTH = 64
_MASK = (1 << 61) - 1


class Entry:
    """One collective this rank issued: its place in the group's sequence and what it was for."""

    __slots__ = ("seq", "kind", "numel", "dtype", "label", "activity", "issued")

    def __init__(self, seq: int, kind: str, numel: int, dtype: torch.dtype, label: str, activity: str) -> None:
        self.seq = seq
        self.kind = kind
        self.numel = numel
        self.dtype = dtype
        self.label = label
        self.activity = activity
        self.issued = time.monotonic()

    def describe(self) -> str:
        """``#12 all_gather of 4096 float32 (unit 3 `blocks.0.weight`, ...) in `forward` of engine ...``."""
        dtype = str(self.dtype).replace("torch.", "")
        what = f" ({self.label})" if self.label else ""
        return f"#{self.seq} {self.kind} of {self.numel} {dtype}{what} in {self.activity}"


# ------------------------------------------------------------------ activity
_STACK: list["doing"] = []
_IDLE = "no engine call (between `engine` calls)"


def current_activity() -> str:
    """The innermost engine call running now, as messages name it."""
    return _STACK[-1].text if _STACK else _IDLE


def current_phase() -> Optional[str]:
    """The innermost engine call's name (``generate``), None between engine calls."""
    return _STACK[-1].phase if _STACK else None


def innermost() -> Optional["doing"]:
    """The innermost engine call running now (None between engine calls)."""
    return _STACK[-1] if _STACK else None


def start(call: Optional["doing"] = None) -> None:
    """Engine call ``call`` (default: the innermost) has started changing state (its ranks agreed on it): a
    failure from now on counts in :attr:`doing.failures` (an argument refused before this point, or an
    agreement that did not come about, changes nothing, and does not)."""
    if call is None:
        call = innermost()
    if call is not None:
        call.started = True


class doing:  # noqa: N801 - used as a context manager, reads like one
    """``with doing("backward", engine.label):`` marks what this process does until the block ends.

    An exception leaving the block is published for the other ranks (their
    errors then say this rank failed and why, instead of only that it stopped
    answering), once however many blocks it leaves.  When the call had
    :func:`start` ed, it also counts in :attr:`failures`, which every
    announcement and step check compares across ranks (:mod:`.control`): a
    failure on some ranks only can never be followed by a silent pairing of
    the ranks' next collectives.  A class, not a generator: it runs three times
    per training step.
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
        _STACK.append(self)
        return self

    def __exit__(self, kind: Any, exc: Optional[BaseException], tb: Any) -> None:
        if _STACK and _STACK[-1] is self:
            _STACK.pop()
        if exc is None:
            return
        # marks on the exception itself (not a reference to it here: it holds its frames, and their tensors)
        if self.started and not _marked(exc, "_shardwise_counted"):
            doing.failures += 1
        if doing.on_error is not None and not _marked(exc, "_shardwise_published"):
            doing.on_error(exc, self.text)


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
        self.log: collections.deque[Entry] = collections.deque(maxlen=LOG_LENGTH)
        self.last: Optional[Entry] = None
        #: the collective a ``wait()`` is blocked on right now (None: not waiting)
        self.waiting: Optional[Entry] = None
        #: set by the first failure: every later collective on the group raises it again
        self.broken: Optional[BaseException] = None
        self._keys: dict[tuple[str, int, torch.dtype, str], int] = {}
        #: the control group used by the step check and ``comms.debug`` (made on first use)
        self.control: Any = None
        #: the announced operation running on this group now (None: none); announcements nested in it are skipped
        self.scope: Any = None
        #: engines built on this group so far (an engine's index names it in announcements)
        self.engines = 0
        #: what this rank's waits read of the errors other ranks published (made on first use)
        self.peer_errors: Any = None

    def record(self, kind: str, numel: int, dtype: torch.dtype, label: str) -> Entry:
        """Give the next collective its number and fold it into the fingerprint."""
        self.seq += 1
        self.fingerprint = ((self.fingerprint * 1000003) ^ self.key_of(kind, numel, dtype, label)) & _MASK
        entry = Entry(self.seq, kind, numel, dtype, label, _STACK[-1].text if _STACK else _IDLE)
        self.log.append(entry)
        self.last = entry
        return entry

    def key_of(self, kind: str, numel: int, dtype: torch.dtype, label: str) -> int:
        """A number that is the same on every rank for the same collective (``hash`` is salted per process)."""
        signature = (kind, numel, dtype, label)
        key = self._keys.get(signature)
        if key is None:
            key = zlib.crc32(f"{kind}|{numel}|{dtype}|{label}".encode())
            if len(self._keys) < 4096:
                self._keys[signature] = key
        return key

    def status(self) -> dict[str, Any]:
        """This group's position, for the heartbeat record (read from another thread: no iteration)."""
        last, waiting = self.last, self.waiting
        return {
            "seq": self.seq,
            "last": last.describe() if last is not None else None,
            "waiting": waiting.describe() if waiting is not None else None,
            "waited": round(time.monotonic() - waiting.issued, 3) if waiting is not None else 0.0,
        }

    def recent(self, count: int = 8) -> list[str]:
        """The last ``count`` collectives, oldest first."""
        return [entry.describe() for entry in list(self.log)[-count:]]


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
