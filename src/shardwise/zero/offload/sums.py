"""Digests of what a rank wrote into its offload files, checked against what it reads back.

A file under ``nvme_path`` can change between a write and a read with no error (another process, the disk, the page
cache); trained on, such bytes make the loss inf or move weights silently.  So every write of a run of bytes records a
64-bit digest (xxHash's XXH3, chosen by measurement: docs/offload.md), and every read checks each recorded run inside
what it read.  Runs never overlap; a write drops the digests of runs it overlaps. Bytes a read finds with no digest get
one from that read.  A memory map may be written through (a checkpoint load): the runs it touches are checked when it is
made, their digests suspended while a map lives, and taken anew from the file once the last one is freed.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

import xxhash

__all__ = ["Mismatch", "Sums", "digest"]


def digest(data: memoryview) -> int:
    """The 64-bit XXH3 digest of ``data`` (the GIL is released while it runs, so an I/O thread overlaps the step)."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class Mismatch:
    """Bytes ``[start, end)`` of a file do not have the digest that was recorded when they were written."""

    start: int
    end: int
    expected: int
    found: int


class _Runs:
    """One file's runs: sorted, disjoint ``(start, end, digest)``, and the ranges suspended under live maps."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.runs: list[tuple[int, int, int]] = []
        self.suspended: list[tuple[int, int]] = []
        self.maps: list[tuple[int, int]] = []

    def overlapping(self, start: int, end: int) -> list[int]:
        """Indices of the runs that overlap ``[start, end)``."""
        first = max(0, bisect.bisect_right(self.starts, start) - 1)
        found = []
        for index in range(first, len(self.runs)):
            run_start, run_end, _ = self.runs[index]
            if run_start >= end:
                break
            if run_end > start:
                found.append(index)
        return found

    def drop(self, indices: list[int]) -> list[tuple[int, int, int]]:
        dropped = [self.runs[i] for i in indices]
        for index in reversed(indices):
            del self.runs[index], self.starts[index]
        return dropped

    def add(self, start: int, end: int, value: int) -> None:
        self.drop(self.overlapping(start, end))
        at = bisect.bisect_left(self.starts, start)
        self.starts.insert(at, start)
        self.runs.insert(at, (start, end, value))

    def mapped(self, start: int, end: int) -> bool:
        """Whether a live map or a suspended range touches ``[start, end)`` (no digest may be taken there)."""
        return any(s < end and start < e for s, e in (*self.maps, *self.suspended))


def _gaps(start: int, end: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``[start, end)`` that no range of ``covered`` (sorted by start) covers."""
    gaps, at = [], start
    for lo, hi in covered:
        if lo > at:
            gaps.append((at, min(lo, end)))
        at = max(at, hi)
        if at >= end:
            break
    if at < end:
        gaps.append((at, end))
    return [(lo, hi) for lo, hi in gaps if lo < hi]


class Sums:
    """The digests of one rank's offload files, by file name (safe to use from the I/O thread and the caller)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: Optional[int] = None
        self._files: dict[str, _Runs] = {}
        #: maps freed while this thread held the lock (a collection inside it): released at the next call
        self.deferred: list[tuple[str, int, int]] = []

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None

    def held_here(self) -> bool:
        """Whether this thread is inside one of these methods (a map freed by a collection run there must wait:
        the lock is not re-entrant, and the tables are half-changed)."""
        return self._holder == threading.get_ident()

    def _runs(self, name: str) -> _Runs:
        return self._files.setdefault(name, _Runs())

    def forget(self, name: str) -> None:
        """The file is new (created, or made anew): nothing is known of it."""
        with self._locked():
            self._files.pop(name, None)

    def wrote(self, name: str, offset: int, data: memoryview) -> None:
        """``data`` was written at ``offset``: its digest replaces those of the runs it overlaps."""
        value = digest(data)
        end = offset + len(data)
        with self._locked():
            runs = self._runs(name)
            if runs.mapped(offset, end):
                runs.drop(runs.overlapping(offset, end))  # taken anew once the maps are gone
            else:
                runs.add(offset, end, value)

    def dropped(self, name: str, start: int, end: int) -> None:
        """A write of ``[start, end)`` failed part-way: what the runs it overlaps hold is not known."""
        with self._locked():
            runs = self._runs(name)
            runs.drop(runs.overlapping(start, end))

    def check(self, name: str, offset: int, data: memoryview, fill: bool = True) -> Optional[Mismatch]:
        """``data`` was read at ``offset``: the first run inside it whose bytes changed, or None.

        With ``fill``, bytes with no digest get one now (unless a map may write them)."""
        end = offset + len(data)
        with self._locked():
            runs = self._runs(name)
            touching = [runs.runs[i] for i in runs.overlapping(offset, end)]
            blocked = [*runs.maps, *runs.suspended]
        for start, stop, expected in touching:
            if offset <= start and stop <= end:
                found = digest(data[start - offset : stop - offset])
                if found != expected:
                    return Mismatch(start, stop, expected, found)
        if not fill:
            return None
        covered = sorted([(s, e) for s, e, _ in touching] + blocked)
        fresh = [(lo, hi, digest(data[lo - offset : hi - offset])) for lo, hi in _gaps(offset, end, covered)]
        with self._locked():
            runs = self._runs(name)
            for lo, hi, value in fresh:
                if not runs.overlapping(lo, hi) and not runs.mapped(lo, hi):  # (nothing wrote there meanwhile)
                    runs.add(lo, hi, value)
        return None

    def span(self, name: str, start: int, end: int) -> tuple[int, int]:
        """``[start, end)`` grown to the runs it touches: what a map must cover to check them."""
        with self._locked():
            runs = self._runs(name)
            touching = [runs.runs[i] for i in runs.overlapping(start, end)]
        return min([start, *(s for s, _, _ in touching)]), max([end, *(e for _, e, _ in touching)])

    def suspend(self, name: str, start: int, end: int) -> None:
        """A map of ``[start, end)`` (checked already) is handed out: its runs' digests wait for its end."""
        with self._locked():
            runs = self._runs(name)
            dropped = runs.drop(runs.overlapping(start, end))
            known = sorted([(s, e) for s, e, _ in dropped] + runs.suspended)
            runs.suspended = sorted(runs.suspended + [(s, e) for s, e, _ in dropped] + _gaps(start, end, known))
            runs.maps.append((start, end))

    def released(self, name: str, start: int, end: int) -> list[tuple[int, int]]:
        """The map of ``[start, end)`` is gone: the suspended ranges no live map touches any more (the caller
        sums them from the file and :meth:`resumed` each)."""
        with self._locked():
            runs = self._files.get(name)
            if runs is None or (start, end) not in runs.maps:
                return []
            runs.maps.remove((start, end))
            free = [(s, e) for s, e in runs.suspended if not any(s < me and ms < e for ms, me in runs.maps)]
            runs.suspended = [r for r in runs.suspended if r not in free]
            return free

    def resumed(self, name: str, start: int, end: int, value: Optional[int]) -> None:
        """The suspended range ``[start, end)`` holds bytes of digest ``value`` now (None: they could not be read)."""
        with self._locked():
            runs = self._files.get(name)
            if runs is not None and value is not None and not runs.mapped(start, end):
                runs.add(start, end, value)
