"""What rank 0 shows while training: a tqdm bar on a terminal, plain log lines otherwise (docs/trainer.md).

A terminal that reports 0 columns (some ptys, CI consoles) gets the lines: a bar there would draw nothing at all. While
``fit()`` runs (:func:`routed_logs`) the engine's own step lines are dropped (the display and the metrics file carry
them, and a line printed straight to the terminal would break the bar) and other lines go through ``tqdm.write``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, Optional, TextIO

from tqdm import tqdm

from ..log import LOGGER_NAME

__all__ = ["Progress", "make_progress", "routed_logs"]

#: the Engine method that writes the periodic step line (``Engine._report``)
_STEP_LINE_FUNCTION = "_report"


def _rate(record: dict[str, Any]) -> str:
    if record.get("tokens_per_s") is not None:
        return f"{record['tokens_per_s']:,.0f} tokens/s"
    if record.get("samples_per_s") is not None:
        return f"{record['samples_per_s']:,.1f} samples/s"
    return ""


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class Progress:
    """Shows nothing (ranks other than 0); the base of the two that do."""

    def start(self, total: Optional[int], initial: int) -> None:
        """Training begins at step ``initial`` of ``total`` (None: unknown)."""

    def step(self, metrics: dict[str, Any]) -> None:
        """After every step, with that step's metrics."""

    def log(self, record: dict[str, Any]) -> None:
        """At a log point, with the full record."""

    def message(self, text: str) -> None:
        """A line of news (evaluation, save, stop)."""

    def close(self) -> None:
        """Training ended."""


class Lines(Progress):
    """One plain line per log point, for logs and pipes."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.total: Optional[int] = None

    def start(self, total: Optional[int], initial: int) -> None:
        self.total = total

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        width = len(str(self.total)) if self.total else 5
        parts = [f"step {step:{width}d}" + (f"/{self.total}" if self.total else ""), f"epoch {record['epoch']}",
                 f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}"]
        if rate := _rate(record):
            parts.append(rate)
        if self.total and record.get("step_time"):
            parts.append(f"eta {_duration((self.total - step) * record['step_time'])}")
        self.message(" | ".join(parts))

    def message(self, text: str) -> None:
        print(text, file=self.stream, flush=True)


#: weight of the newest step in the bar's smoothed rate (about the last 10 steps count)
_SMOOTHING = 0.2


class Bar(Progress):
    """A tqdm progress bar with loss, lr and throughput; messages print above it."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.bar: Any = None
        self.rate = ""
        self.smoothed: dict[str, float] = {}

    def start(self, total: Optional[int], initial: int) -> None:
        self.bar = tqdm(total=total, initial=initial, unit="step", file=self.stream, dynamic_ncols=True,
                        desc="train", smoothing=0.1)

    def step(self, metrics: dict[str, Any]) -> None:
        for key in ("tokens_per_s", "samples_per_s"):
            value, old = metrics.get(key), self.smoothed.get(key)
            if isinstance(value, (int, float)):
                self.smoothed[key] = value if old is None else old + _SMOOTHING * (value - old)
        postfix = {"loss": f"{metrics['loss']:.4f}", "lr": f"{metrics['lr']:.2e}"}
        if rate := _rate(self.smoothed) or self.rate:
            postfix["speed"] = rate
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def log(self, record: dict[str, Any]) -> None:
        self.rate = _rate(record)

    def message(self, text: str) -> None:
        if self.bar is None:
            print(text, file=self.stream, flush=True)
        else:
            self.bar.write(text, file=self.stream)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def make_progress(rank: int, progress: bool, stream: Optional[TextIO] = None) -> Progress:
    """Rank 0's display: a bar when ``progress`` and the stream is a terminal, lines otherwise."""
    stream = stream if stream is not None else sys.stdout
    if rank != 0:
        return Progress()
    if progress and stream.isatty() and _columns(stream) != 0:
        return Bar(stream)
    return Lines(stream)


def _columns(stream: TextIO) -> Optional[int]:
    """The terminal's width (None when the stream has no file descriptor to ask)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None


class _Route(logging.Filter):
    """Keeps ``shardwise`` records away from the handler; shows them through ``show`` instead."""

    def __init__(self, handler: logging.Handler, show: Callable[[str], None]) -> None:
        super().__init__()
        self.handler, self.show = handler, show

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(LOGGER_NAME):
            return True
        if record.funcName != _STEP_LINE_FUNCTION:
            self.show(self.handler.format(record))
        return False


@contextlib.contextmanager
def routed_logs(show: Callable[[str], None]) -> Iterator[None]:
    """Within the block, ``shardwise`` records print through ``show`` and the engine's step lines not at all."""
    logger = logging.getLogger(LOGGER_NAME)
    # The handlers a `shardwise` record reaches: its logger's, then (when it propagates) the root's.
    handlers = logger.handlers + (logging.getLogger().handlers if logger.propagate else [])
    # Only consoles: a log file keeps every line, and cannot break a bar.
    routes = [(h, _Route(h, show)) for h in handlers
              if isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr)]
    for handler, route in routes:
        handler.addFilter(route)
    try:
        yield
    finally:
        for handler, route in routes:
            handler.removeFilter(route)
