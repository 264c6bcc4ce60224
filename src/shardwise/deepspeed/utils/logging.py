"""DeepSpeed's `logger` and `log_dist`, on the `shardwise` logger."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch.distributed as dist

__all__ = ["log_dist", "logger", "print_dist"]

#: what `from deepspeed.utils import logger` gives a script: here shardwise's own logger
logger = logging.getLogger("shardwise")


def _should_log(ranks: Sequence[int] | None) -> bool:
    """DeepSpeed's rule: always without a process group; else when this rank is in `ranks` (-1: every rank)."""
    if not dist.is_initialized():
        return True
    chosen = list(ranks) if ranks is not None else []
    return -1 in chosen or dist.get_rank() in chosen


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` (prefixed with the rank) on the ranks in `ranks`; `[-1]` means every rank."""
    if _should_log(ranks):
        rank = dist.get_rank() if dist.is_initialized() else -1
        logger.log(level, "[Rank %d] %s", rank, message)


def print_dist(message: str, ranks: Sequence[int] | None = None) -> None:
    """As :func:`log_dist`, but printed whatever the log level."""
    if _should_log(ranks):
        rank = dist.get_rank() if dist.is_initialized() else -1
        print(f"[Rank {rank}] {message}", flush=True)
