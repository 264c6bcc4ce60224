"""How a config is reported on: one error listing every problem, each with its dotted key path, and info lines.

Info lines (what was ignored and why, what an `auto` became, which alias was read) go to the `shardwise`
logger, once per line per config, and only on rank 0 when a process group exists (every rank reads the
same config, so one copy is enough).
"""

from __future__ import annotations

import difflib
import logging
import reprlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["MAX_SHOWN", "ConfigError", "Note", "Problems", "announce", "canonical", "problem_line", "shown_value",
           "suggest"]

logger = logging.getLogger("shardwise")

#: problems a ConfigError message lists (the rest are counted: "... and N more"); `problems` keeps all.
MAX_SHOWN = 20
#: characters of one problem line in the message; a line longer than this (a 1 MB key) is cut.
_MAX_LINE = 400
#: closest known keys named for an unknown key that has no single close match
_MAX_CLOSE = 3

_VALUES = reprlib.Repr()
_VALUES.maxstring, _VALUES.maxother, _VALUES.maxlist, _VALUES.maxdict, _VALUES.maxlevel = 60, 60, 6, 4, 3


def shown_value(value: Any) -> str:
    """`repr(value)`, cut short for a long string or a big collection (messages stay small)."""
    return _VALUES.repr(value)


def _cut(line: str) -> str:
    return line if len(line) <= _MAX_LINE else line[:_MAX_LINE] + f"... ({len(line)} characters)"


class ConfigError(ValueError):
    """An invalid config. `problems` holds one line per problem; the message lists all of them."""

    def __init__(self, problems: str | Sequence[str], source: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        count = len(self.problems)
        where = f" in {source}" if source else ""
        head = f"invalid shardwise config{where} ({count} problem{'' if count == 1 else 's'}):"
        lines = [head, *(f"  - {_cut(line)}" for line in self.problems[:MAX_SHOWN])]
        if count > MAX_SHOWN:
            lines.append(f"  ... and {count - MAX_SHOWN} more (fix these first; `.problems` lists all)")
        super().__init__("\n".join(lines))

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
    """`did you mean X?` for the closest known key, else at most three known keys nearest to it.

    Never the whole list: with hundreds of unknown keys that repeated it for each one.
    """
    known = sorted(set(known))
    text = str(key)[:100]  # a long key costs difflib time and matches nothing
    close = difflib.get_close_matches(text, known, n=1, cutoff=0.6)
    if close:
        return f"did you mean `{close[0]}`?"
    nearest = difflib.get_close_matches(text, known, n=_MAX_CLOSE, cutoff=0.0)
    return "remove it (nearest known keys: " + ", ".join(f"`{k}`" for k in nearest) + ")"


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


@dataclass(frozen=True)
class Note:
    """One info line about the key at `path` (dotted, from the config's top level)."""

    path: str
    message: str

    def __str__(self) -> str:
        return self.message


def announce(notes: Iterable[Note], already: frozenset[str] = frozenset()) -> frozenset[str]:
    """Log each note whose message is not in `already`; return every message now announced."""
    done = set(already)
    quiet = dist.is_available() and dist.is_initialized() and dist.get_rank() != 0
    for note in notes:
        if note.message in done:
            continue
        done.add(note.message)
        if not quiet:
            logger.info("config: %s", note.message)
    return frozenset(done)
