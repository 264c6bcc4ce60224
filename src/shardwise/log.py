"""Where the ``shardwise`` logger's lines go until the program decides.

Python drops INFO lines of a logger nobody configured, which would make "accepted with an info line" silent in
practice; so, as DeepSpeed does, ``initialize`` gives that logger one handler writing ``[shardwise] message`` to
stdout at INFO (README.md says what goes there; ``SHARDWISE_LOG_LEVEL`` changes the level).  A program that configured
logging before ``initialize`` (a root handler, or a handler on ``shardwise``) keeps full control: nothing is added then.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["LOGGER_NAME", "install_default_handler"]

LOGGER_NAME = "shardwise"


def install_default_handler() -> None:
    """Add the default handler once, unless logging is already configured."""
    logger = logging.getLogger(LOGGER_NAME)
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[shardwise] %(message)s"))
    logger.addHandler(handler)
    level = os.environ.get("SHARDWISE_LOG_LEVEL", "INFO").upper()
    logger.setLevel(level if level in logging.getLevelNamesMapping() else "INFO")
    logger.propagate = False  # the root has no handler: nothing would print twice, and nothing is lost
