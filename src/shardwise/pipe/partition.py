"""Which layers go to which stage: DeepSpeed's ``partition_method`` values (docs/pipeline.md).

The result is always a list of ``num_stages + 1`` boundaries and every stage gets at least one layer.
``type:`` balancing minimises the heaviest stage first and then, among those partitions, the longest stage, so
layers that weigh nothing (functions, activations) spread instead of piling up on one stage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

__all__ = ["balanced", "least_spread", "partition", "uniform"]

Weigh = Callable[[int], int]


def partition(names: Sequence[str], weigh: Weigh, num_stages: int, method: Any) -> list[int]:
    """Boundaries for ``len(names)`` layers (``names[i]``: layer ``i``'s class name) over ``num_stages`` stages;
    ``weigh(i)`` is its trainable parameter count (only called for ``"parameters"``)."""
    count = len(names)
    if count < num_stages:
        raise ValueError(
            f"{count} layer(s) cannot fill {num_stages} pipeline stages: every stage needs at least one "
            f"layer; pass `num_stages` <= {count} or split the model into more layers")
    if isinstance(method, (list, tuple)):
        return _explicit(list(method), count, num_stages)
    lowered = method.lower() if isinstance(method, str) else None
    if lowered == "uniform":
        return uniform(count, num_stages)
    if lowered == "parameters":
        weights = [weigh(i) for i in range(count)]
        return least_spread(weights, num_stages) if count > num_stages else uniform(count, num_stages)
    if lowered is not None and lowered.startswith("type:"):
        return balanced(_type_weights(names, method[len("type:") :]), num_stages)
    raise ValueError(
        f"unknown partition_method {f'`{method}`' if isinstance(method, str) else repr(method)}; expected "
        "`parameters`, `uniform`, `type:REGEX` (e.g. `type:Block`) or a list of layer boundaries `[0, ..., num_layers]`"
    )


def _type_weights(names: Sequence[str], pattern: str) -> list[int]:
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as error:
        raise ValueError(f"partition_method `type:{pattern}`: `{pattern}` is not a valid regular expression ({error})") from None
    weights = [1 if regex.search(name) else 0 for name in names]
    if not any(weights):
        raise ValueError(
            f"partition_method `type:{pattern}` matches no layer; the layers' class names are "
            f"{sorted(set(names))}")
    return weights


def _explicit(bounds: list[Any], count: int, num_stages: int) -> list[int]:
    fine = (
        len(bounds) == num_stages + 1
        and all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
        and bounds[0] == 0
        and bounds[-1] == count
        and all(a < b for a, b in zip(bounds, bounds[1:])))
    if not fine:
        raise ValueError(
            f"partition_method {bounds!r} is not a valid list of boundaries: expected {num_stages + 1} "
            f"increasing integers from 0 to {count} (stage s runs layers [b[s], b[s+1])), e.g. "
            f"{uniform(count, num_stages)}")
    return bounds


def uniform(count: int, parts: int) -> list[int]:
    """Boundaries giving each part ``count // parts`` layers, the first ``count % parts`` parts one more."""
    size, extra = divmod(count, parts)
    return [part * size + min(part, extra) for part in range(parts + 1)]


def balanced(weights: Sequence[int], parts: int) -> list[int]:
    """Contiguous non-empty parts: least possible heaviest part, then least possible longest part."""
    count = len(weights)
    if not any(weights):
        return uniform(count, parts)
    cap_weight = _least(max(weights), sum(weights), lambda w: _min_parts(weights, 0, w, count) <= parts)
    floor = -(-count // parts)
    cap_count = _least(floor, count, lambda c: _min_parts(weights, 0, cap_weight, c) <= parts)
    return _cut(weights, parts, cap_weight, cap_count)


def _least(low: int, high: int, fits: Callable[[int], bool]) -> int:
    """Smallest value in ``[low, high]`` for which ``fits`` holds (``fits(high)`` must)."""
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return low


def _min_parts(weights: Sequence[int], start: int, cap_weight: int, cap_count: int) -> int:
    """Fewest parts covering ``weights[start:]`` with no part over either cap (greedy is optimal)."""
    parts, weight, length = 0, 0, 0
    for w in weights[start:]:
        if w > cap_weight:
            return len(weights) + 1
        if length and (weight + w > cap_weight or length == cap_count):
            parts, weight, length = parts + 1, 0, 0
        weight, length = weight + w, length + 1
    return parts + (1 if length else 0)


def _cut(weights: Sequence[int], parts: int, cap_weight: int, cap_count: int) -> list[int]:
    """Left to right, each part as long as the caps allow while one layer is left for every later part.

    That is the greedy packing ``_min_parts`` counts, so the caps found by
    :func:`balanced` guarantee the later parts fit.
    """
    count = len(weights)
    bounds = [0]
    for left in range(parts - 1, 0, -1):  # parts still to place after this one
        start = end = bounds[-1]
        weight = 0
        while (
            end < count - left
            and end - start < cap_count
            and (end == start or weight + weights[end] <= cap_weight)
        ):
            weight += weights[end]
            end += 1
        bounds.append(end)
    bounds.append(count)
    return bounds


@dataclass(frozen=True)
class _Cell:
    """The kept partition of the first ``i`` layers into ``j`` stages: spread, heaviest, lightest, last cut."""

    spread: int
    heaviest: int
    lightest: int
    start: int


def least_spread(weights: Sequence[int], parts: int) -> list[int]:
    """Boundaries ``[0, b1, ..., len(weights)]`` of ``parts`` non-empty stages, as DeepSpeed balances them.

    DeepSpeed (``runtime/utils.py``, ``partition_balanced``) does not minimise the heaviest stage: it fills a table over
    (first ``i`` layers, ``j`` stages) keeping, for each cell, the cut whose heaviest minus lightest stage is smallest
    given the best cell for ``j - 1`` stages, and on a tie the cut with the *last* stage shortest (the latest start).
    That is not always the least spread overall, but a checkpoint or a script tuned for DeepSpeed expects those
    boundaries (AlexNet on 2 stages: layer 19, not 17); re-implemented in exact integer arithmetic. Needs
    ``len(weights) > parts`` (DeepSpeed splits uniformly otherwise).
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

