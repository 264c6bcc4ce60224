"""The ``shardwise`` console command: ``run`` (torchrun), ``generate``, ``env``, ``plot``, ``config``, ``checkpoint``."""

from __future__ import annotations

from .commands import main

__all__ = ["main"]
