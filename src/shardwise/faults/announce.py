"""Every collective operation announces itself: the ranks agree on it before any of its data moves.

A collective API called on some ranks only (``if rank == 0: engine.full_state_dict()``) used to pair its
gathers with whatever the other ranks ran next.  Now each such operation first announces, over the group's
control group (:meth:`~shardwise.comm.distributed.Comm.agree`, one exchange per operation), which operation of
which engine at which step, and how many engine calls of the process failed; ranks in different operations
raise :class:`~.errors.CollectiveMismatchError` on every rank before any data moves, and the group stays usable.
What announces, and when, is in docs/faults.md ("Announcements"); :data:`OPERATIONS` lists it for the test that every
public collective does.  An announcement inside another on the same group is skipped.
"""

from __future__ import annotations

import functools
import inspect
import os
import weakref
import zlib
from typing import Any, Callable, Optional, TypeVar, cast

from . import control
from . import ledger as _ledger
from .ledger import doing

__all__ = ["OPERATIONS", "STRICT", "WHAT", "Announcer", "Scope", "code", "collective", "register"]

#: qualified name of every public collective -> the operation it announces
OPERATIONS: dict[str, str] = {}
#: a collective issued outside any announced operation raises (tests; see the module docstring)
STRICT = os.environ.get("SHARDWISE_STRICT_COLLECTIVES", "") == "1"

_F = TypeVar("_F", bound=Callable[..., Any])


def register(qualname: str, operation: str) -> None:
    """Record that ``qualname`` announces ``operation`` (for what announces without :func:`collective`)."""
    OPERATIONS[qualname] = operation


def code(operation: str) -> int:
    """The number an announcement gives ``operation`` (the same on every rank)."""
    return zlib.crc32(operation.encode())


#: how an announcement says where this rank is (the engine's own `backward` announces with it too)
WHAT = "in {operation} of {owner}{detail} at step {steps} (micro-step {micro})"


class Announcer:
    """The announcements of one engine (or one collective function) on ``comm``'s group.

    ``owner`` names it in messages; ``counters()`` gives its ``(global_steps, micro_steps)``; an engine
    (``engine=True``) takes the next index on the group, the same on every rank (they build their engines in
    the same order: the construction agreement checks it).
    """

    def __init__(self, comm: Any, owner: str, counters: Optional[Callable[[], tuple[int, int]]] = None,
                 engine: bool = True) -> None:
        self.comm = comm
        self.owner = owner
        # an engine's method is held weakly: a stage-3 model kept after its engine was dropped announces
        # through its hooks' announcer, which must not keep the engine (and its strategy) alive
        fixed = counters if counters is not None else (lambda: (0, 0))
        self._counters: Callable[[], Optional[Callable[[], tuple[int, int]]]] = (
            weakref.WeakMethod(fixed) if inspect.ismethod(fixed) else lambda: fixed)
        self.index = -1
        if engine:
            self.index = comm.ledger.engines
            comm.ledger.engines += 1

    def scope(self, operation: str, announce: bool = True, detail: str = "", after_agreement: bool = False) -> "Scope":
        """Around one operation: announced when it opens (unless ``announce`` is False: it moves no data, or
        has an agreement of its own), unless another already covers the group.  ``detail`` (``, in
        `generate`,``) is part of the operation: the same operation with another detail is another.
        ``after_agreement``: announced by the store agreement that starts the operation (:meth:`Scope.agreed`,
        called by :func:`shardwise.comm.agreement.join`), not when it opens."""
        return Scope(self, operation, announce, detail, after_agreement)

    def announce(self, operation: str, detail: str = "") -> None:
        """Agree with the other ranks that each is about to run ``operation`` (raises on every rank if not)."""
        comm = self.comm
        counters = self._counters()
        steps, micro = counters() if counters is not None else (0, 0)  # (0, 0): its engine is gone
        what = WHAT.format(operation=_name(operation), owner=self.owner, detail=detail, steps=steps, micro=micro)
        comm.agree([control.ANNOUNCE, code(operation + detail), self.index, steps, micro], control.ANNOUNCED, what)


def _name(operation: str) -> str:
    """How a message names an operation: an API call in backticks, a described pass as it is."""
    return operation if " " in operation else f"`{operation}`"


class Scope:
    """One announced operation on a group; a context manager, or :meth:`open` and :meth:`close` (module hooks).

    Opening it announces (see :meth:`Announcer.scope`), then marks the innermost engine call started: a
    failure from there on counts (:attr:`~.ledger.doing.failures`), one before it (an argument refused) does not.
    """

    __slots__ = ("announcer", "operation", "announce", "detail", "owned", "deferred", "call")

    def __init__(self, announcer: Announcer, operation: str, announce: bool, detail: str = "",
                 after_agreement: bool = False) -> None:
        self.announcer = announcer
        self.operation = operation
        self.announce = announce
        self.detail = detail
        self.owned = False
        #: announced by the operation's store agreement, which has not run yet
        self.deferred = after_agreement
        #: the engine call this operation runs in (a failure counts once the operation started)
        self.call = _ledger.innermost()

    def open(self) -> "Scope":
        announcer = self.announcer
        comm = announcer.comm
        if comm.distributed and comm.ledger.scope is None:
            if self.announce and not self.deferred:
                announcer.announce(self.operation, self.detail)
            comm.ledger.scope = self
            self.owned = True
        else:
            self.deferred = False  # one process, or inside another operation: nothing to announce
        if not self.deferred:
            _ledger.start(self.call)
        return self

    def agreed(self) -> None:
        """The operation's store agreement is over (every rank joined, or the ranks that did not wait in another
        operation's announcement): announce it now (raises on every rank if the ranks are in different
        operations).  Only the first agreement of the operation announces it."""
        if self.deferred:
            self.deferred = False
            if self.announce:
                self.announcer.announce(self.operation, self.detail)
            _ledger.start(self.call)

    def close(self) -> None:
        if self.owned:
            self.owned = False
            ledger = self.announcer.comm.ledger
            if ledger.scope is self:
                ledger.scope = None

    __enter__ = open

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        self.close()


def collective(operation: str, after_agreement: bool = False) -> Callable[[_F], _F]:
    """Decorate an engine method that is collective: it runs as engine call ``operation`` (what messages name,
    :class:`~.ledger.doing`), announced on the engine's group first (``self._announcer``), or by its store
    agreement (``after_agreement``: the checkpoint operations, see the module docstring)."""

    def wrap(method: _F) -> _F:
        register(method.__qualname__, operation)

        @functools.wraps(method)
        def announced(self: Any, *args: Any, **kwargs: Any) -> Any:
            with doing(operation, self._announcer.owner), \
                    self._announcer.scope(operation, after_agreement=after_agreement):
                return method(self, *args, **kwargs)

        return cast(_F, announced)

    return wrap
