"""`deepspeed.utils` for client scripts: `RepeatingLoader`, `logger`, `log_dist`, `groups`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from . import groups
from .logging import log_dist, logger, print_dist

__all__ = ["RepeatingLoader", "groups", "log_dist", "logger", "print_dist"]


class RepeatingLoader:
    """Iterate ``loader`` forever: when it runs out, start it again (a new epoch of a DataLoader).

    As DeepSpeed's ``deepspeed.utils.RepeatingLoader``; the pipeline's ``train_batch()`` draws
    ``gradient_accumulation_steps`` micro-batches from one at every call.
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter: Iterator[Any] = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            # A loader that is empty from the start raises StopIteration here too: no endless loop.
            return next(self.data_iter)
