"""DeepSpeed's `logger` and `log_dist`, on the `shardwise` logger."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch.distributed as dist

__all__ = ["log_dist", "logger", "print_dist"]

#: what `from deepspeed.utils import logger` gives a script: here shardwise's own logger
logger = logging.getLogger("shardwise")


def _rank_to_log(ranks: Sequence[int] | None) -> int | None:
    """This rank (-1 without a process group) when DeepSpeed's rule logs here: always without a process group,
    else when this rank is in `ranks` (-1: every rank); None when it does not."""
    if not dist.is_initialized():
        return -1
    chosen = list(ranks) if ranks is not None else []
    return dist.get_rank() if -1 in chosen or dist.get_rank() in chosen else None


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` (prefixed with the rank) on the ranks in `ranks`; `[-1]` means every rank."""
    if (rank := _rank_to_log(ranks)) is not None:
        logger.log(level, "[Rank %d] %s", rank, message)


def print_dist(message: str, ranks: Sequence[int] | None = None) -> None:
    """As :func:`log_dist`, but printed whatever the log level."""
    if (rank := _rank_to_log(ranks)) is not None:
        print(f"[Rank {rank}] {message}", flush=True)
