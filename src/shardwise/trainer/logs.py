"""The ``shardwise`` logger while a Trainer runs: the engine's step lines held back, the rest through the display.

The engine logs ``step N: lr=... grad_norm=...`` every ``steps_per_print``
steps.  Under a Trainer those numbers are already in the display and the
metrics file, and a line printed straight to the terminal would break into
the progress bar (and leave pieces of old bars).  So while ``fit()`` runs, a
filter on the handlers that print ``shardwise`` records drops the engine's step
lines and hands every other line to the display (``tqdm.write`` above a bar).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator

from ..log import LOGGER_NAME

__all__ = ["routed_logs"]

#: the Engine method that writes the periodic step line (``Engine._report``)
_STEP_LINE_FUNCTION = "_report"


class _Route(logging.Filter):
    """Keeps ``shardwise`` records away from the handler; shows them through ``show`` instead."""

    def __init__(self, handler: logging.Handler, show: Callable[[str], None]) -> None:
        super().__init__()
        self.handler = handler
        self.show = show

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(LOGGER_NAME):
            return True
        if record.funcName != _STEP_LINE_FUNCTION:
            self.show(self.handler.format(record))
        return False


def _handlers() -> list[logging.Handler]:
    """The handlers a ``shardwise`` record reaches: its logger's, then (when it propagates) the root's."""
    logger = logging.getLogger(LOGGER_NAME)
    handlers = list(logger.handlers)
    if logger.propagate:
        handlers += logging.getLogger().handlers
    # Only consoles: a log file keeps every line, and cannot break a bar.
    return [h for h in handlers if isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr)]


@contextlib.contextmanager
def routed_logs(show: Callable[[str], None]) -> Iterator[None]:
    """Within the block, ``shardwise`` records print through ``show`` and the engine's step lines not at all."""
    routes = [(handler, _Route(handler, show)) for handler in _handlers()]
    for handler, route in routes:
        handler.addFilter(route)
    try:
        yield
    finally:
        for handler, route in routes:
            handler.removeFilter(route)
