"""How config problems are reported: one error listing every problem, each with its dotted key path."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["ConfigError", "Problems", "canonical", "problem_line", "suggest"]


class ConfigError(ValueError):
    """An invalid config. `problems` holds one line per problem; the message lists all of them."""

    def __init__(self, problems: str | Sequence[str], source: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        count = len(self.problems)
        where = f" in {source}" if source else ""
        head = f"invalid shardwise config{where} ({count} problem{'' if count == 1 else 's'}):"
        super().__init__("\n".join([head, *(f"  - {line}" for line in self.problems)]))

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild from the parts, not the formatted message, so errors survive pickling across ranks.
        return (type(self), (self.problems, self.source))


# A problem found inside a section: (path relative to the section, kind, detail).
# kind: "unknown" (unknown key), "missing" (required key absent), "value" (bad value), "raw" (as is).
Item = tuple[tuple[str, ...], str, str]


class Problems(ValueError):
    """Several problems found by one validator; pydantic keeps the exception, and we expand it."""

    def __init__(self, items: list[Item]) -> None:
        super().__init__("; ".join(detail for _, _, detail in items))
        self.items = items


def problem_line(path: str, kind: str, detail: str) -> str:
    """One problem as the user reads it, e.g. ``unknown key `x.y`; did you mean `z`?``."""
    if kind == "unknown":
        return f"unknown key `{path}`; {detail}"
    if kind == "missing":
        return f"`{path}` is required{detail}"
    return detail if kind == "raw" else f"`{path}`: {detail}"


def suggest(key: Any, known: Iterable[str]) -> str:
    """`did you mean X?` for the closest known key, else the list of known keys."""
    known = sorted(set(known))
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    if close:
        return f"did you mean `{close[0]}`?"
    return "remove it (known keys: " + ", ".join(f"`{k}`" for k in known) + ")"


def canonical(value: Any, names: Iterable[str]) -> str:
    """Match `value` case-insensitively against `names` and return the canonical spelling."""
    by_lower = {n.lower(): n for n in names}
    found = by_lower.get(str(value).lower())
    if found is None:
        allowed = ", ".join(f"`{n}`" for n in by_lower.values())
        close = difflib.get_close_matches(str(value).lower(), list(by_lower), n=1, cutoff=0.6)
        hint = f"; did you mean `{by_lower[close[0]]}`?" if close else ""
        raise ValueError(f"expected one of {allowed} (any case){hint}")
    return found
