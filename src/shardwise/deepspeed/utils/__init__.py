"""`deepspeed.utils` for client scripts: `RepeatingLoader`, `logger`, `log_dist`, `groups`."""

from __future__ import annotations

from . import groups
from .logging import log_dist, logger, print_dist
from .repeating import RepeatingLoader

__all__ = ["RepeatingLoader", "groups", "log_dist", "logger", "print_dist"]
