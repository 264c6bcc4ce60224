"""DeepSpeed's balancing for ``partition_method="parameters"``: least spread between stages.

DeepSpeed (``runtime/utils.py``, ``partition_balanced``) does not minimise the heaviest stage: it fills a
table over (first ``i`` layers, ``j`` stages) keeping, for each cell, the cut whose heaviest minus lightest
stage is smallest given the best cell for ``j - 1`` stages, and on a tie the cut with the *last* stage
shortest (the latest start). The result is not always the partition with the least spread overall, but it is
what DeepSpeed builds, and a checkpoint or a script tuned for DeepSpeed expects those boundaries (AlexNet on 2
stages: layer 19, not 17). This is a re-implementation of that recurrence in exact integer arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["least_spread"]


@dataclass(frozen=True)
class _Cell:
    """The kept partition of the first ``i`` layers into ``j`` stages: spread, heaviest, lightest, last cut."""

    spread: int
    heaviest: int
    lightest: int
    start: int


def least_spread(weights: Sequence[int], parts: int) -> list[int]:
    """Boundaries ``[0, b1, ..., len(weights)]`` of ``parts`` non-empty stages, as DeepSpeed balances them.

    Needs ``len(weights) > parts`` (DeepSpeed splits uniformly otherwise).
    """
    count = len(weights)
    if count <= parts:
        raise ValueError(f"least_spread: {count} weights for {parts} parts; needs more weights than parts")
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    table: list[list[Optional[_Cell]]] = [[None] * (parts + 1) for _ in range(count + 1)]
    for end in range(1, count + 1):
        table[end][1] = _Cell(0, prefix[end], prefix[end], 0)
        for stages in range(2, min(end, parts) + 1):
            table[end][stages] = _best(table, prefix, end, stages)
    bounds = [count]
    for stages in range(parts, 0, -1):
        cell = table[bounds[-1]][stages]
        assert cell is not None
        bounds.append(cell.start)
    return bounds[::-1]


def _best(table: list[list[Optional[_Cell]]], prefix: list[int], end: int, stages: int) -> _Cell:
    """The cell for layers ``[0, end)`` in ``stages`` stages: the last stage is ``[start, end)``."""
    best: Optional[_Cell] = None
    for start in range(stages - 1, end):  # the first `stages - 1` stages need a layer each
        before = table[start][stages - 1]
        assert before is not None  # filled: start >= stages - 1
        last = prefix[end] - prefix[start]
        heaviest, lightest = max(before.heaviest, last), min(before.lightest, last)
        if best is None or heaviest - lightest <= best.spread:  # `<=`: a tie goes to the later start
            best = _Cell(heaviest - lightest, heaviest, lightest, start)
    assert best is not None
    return best

