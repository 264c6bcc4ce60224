"""Bounds on what a checkpoint may ask of the process that reads it.

A checkpoint is untrusted input: each file is read only up to a size limit,
and nothing is allocated from a size it claims until that size has been
checked against the tensor index and the bytes on disk (``validate.py``).
The limits are far above what a real checkpoint needs; they only stop a
crafted file from making a load read or parse gigabytes of metadata.
"""

from __future__ import annotations

__all__ = [
    "MAX_DEPTH", "MAX_DIMS", "MAX_INDEX_BYTES", "MAX_LATEST_BYTES", "MAX_MANIFEST_BYTES",
    "MAX_RANK_FILE_BYTES", "MAX_STORE_VALUE_BYTES", "MAX_TAG_LENGTH", "MAX_WORLD_SIZE",
]

MAX_LATEST_BYTES = 4096
"""``latest`` holds one tag."""

MAX_TAG_LENGTH = 255
"""A tag names one directory entry (the usual file-name limit)."""

MAX_MANIFEST_BYTES = 256 * 2**20
"""``shardwise.json``: about 300 bytes per tensor, so room for ~800k tensors and a large ``client_state``."""

MAX_RANK_FILE_BYTES = 16 * 2**20
"""``rankR.json``: one rank's RNG states (a few KB; more with many CUDA devices)."""

MAX_INDEX_BYTES = 256 * 2**20
"""``.metadata``: DCP's index, about 200 bytes per tensor chunk."""

MAX_STORE_VALUE_BYTES = 256 * 2**20
"""One value the checkpoint agreement reads from the rendezvous store: the largest is rank 0's global
save plan, JSON of about 450-500 bytes per tensor chunk of every rank (measured on a stage-2 save),
so room for ~500k chunks."""

MAX_WORLD_SIZE = 2**20
"""Ranks a manifest may claim (each is a file to look for)."""

MAX_DIMS = 64
"""Dimensions of one tensor."""

MAX_DEPTH = 100
"""Nesting of JSON-encoded values (``client_state``, scheduler state...)."""
