"""The one checked move between the states of stage 3's life cycles (a unit's, a model's training state).

Each life cycle is an enum plus a table of the moves it allows.  Every change of
state goes through :func:`move`, so a move the table lacks raises at once,
naming the thing, the state it was in and the move attempted, instead of
leaving the state wrong for a later step to trip over.
"""

from __future__ import annotations

import enum
from typing import Mapping, TypeVar

__all__ = ["Moves", "UnitError", "move"]

_S = TypeVar("_S", bound=enum.Enum)

#: per state, the states it may move to
Moves = Mapping[_S, frozenset[_S]]


class UnitError(RuntimeError):
    """A unit (or the model holding units) was used against its life cycle (a bug in shardwise or in
    code holding units)."""


def move(rank: int, what: str, current: _S, to: _S, allowed: Moves[_S], event: str, fix: str) -> _S:
    """``to``, when the table ``allowed`` lets ``current`` move there; otherwise a :class:`UnitError`
    naming ``what`` (a unit, a model), the state it was in, the move ``event`` attempted and ``fix``."""
    if to in allowed.get(current, frozenset()):
        return to
    sources = sorted(s.value for s, targets in allowed.items() if to in targets)
    expected = " or ".join(sources) if sources else "(no state: the move is never allowed)"
    raise UnitError(
        f"rank {rank}: {what} cannot {event} ({current.value} -> {to.value}): expected it {expected}, "
        f"found {current.value}; {fix}"
    )
