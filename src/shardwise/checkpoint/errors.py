"""The one error type the checkpoint layer raises for checkpoint problems."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says why and what to do."""
