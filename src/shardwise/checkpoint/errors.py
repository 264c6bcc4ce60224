"""The error types the checkpoint layer raises for checkpoint problems."""

from __future__ import annotations

__all__ = ["CheckpointError", "StoreValueError"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says why and what to do."""


class StoreValueError(CheckpointError):
    """A value in the rendezvous store that the checkpoint agreement reads is not what a rank of it wrote:
    not JSON, above the size bound, or holding a type outside the allow-list (see ``store_codec.py``)."""
