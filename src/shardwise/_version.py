"""The installed shardwise version (one place, read by the package and the checkpoint manifest)."""

__version__ = "0.1.0"
