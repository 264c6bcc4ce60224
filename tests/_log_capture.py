"""The `shardwise` logger's lines while a block runs, whatever logging was set up before."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

__all__ = ["logged"]


@contextlib.contextmanager
def logged() -> Iterator[list[str]]:
    """The `shardwise` logger's lines while the block runs (rank 0 logs them; other ranks get none)."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("shardwise")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
