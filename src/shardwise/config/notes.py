"""Info lines about a config: what was ignored and why, what an `auto` became, which alias was read.

They go to the `shardwise` logger, once per line per config, and only on rank 0 when a process
group exists (every rank reads the same config, so one copy is enough).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["Note", "announce"]

logger = logging.getLogger("shardwise")


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
