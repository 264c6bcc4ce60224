"""The files one rank's offloaded optimizer state lives in (``offload_optimizer: {device: nvme}``).

Each rank of each engine makes its own folder under ``nvme_path`` with
:func:`tempfile.mkdtemp` (a unique name, created atomically), so two jobs or
two engines pointing at the same ``nvme_path`` never share a file.  The folder
is removed when the engine is destroyed and, failing that, when the process
exits (``weakref.finalize`` runs at exit); only a killed process leaves it.

Reads and writes are plain ``pread``/``pwrite`` into and out of tensors the
caller owns, so host memory holds only what the caller preallocated.  The bytes
moved are counted for the measurement in docs/offload.md.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import weakref
from pathlib import Path

import torch

__all__ = ["NvmeFiles", "check_room"]

_KEY = "zero_optimization.offload_optimizer.nvme_path"


def check_room(path: str, needed: int, rank: int, what: str, key: str = _KEY, whose: str = "offloaded optimizer") -> None:
    """Raise before training when ``path`` cannot hold ``needed`` more bytes (``shutil.disk_usage``); ``key``
    is the config key that named the path, ``whose`` what is offloaded there."""
    free = shutil.disk_usage(path).free
    if free < needed:
        raise RuntimeError(
            f"rank {rank}: `{key}` {path!r} has {free:,} bytes free and this rank's {whose} needs "
            f"{needed:,} ({what}); free space there, point `{key}` at a larger disk, or use more ranks")


def _make_folder(root: str, rank: int, key: str) -> Path:
    try:
        os.makedirs(root, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"shardwise-rank{rank}-pid{os.getpid()}-", dir=root))
    except OSError as exc:
        raise RuntimeError(
            f"rank {rank}: cannot make this rank's offload folder under `{key}` {root!r} ({exc}); "
            f"set `{key}` to a writable directory") from exc


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().data


class NvmeFiles:
    """Named files of raw tensor bytes in this rank's own folder under ``root``."""

    def __init__(self, root: str, rank: int, key: str = _KEY) -> None:
        self.folder = _make_folder(root, rank, key)
        self.bytes_read = 0
        self.bytes_written = 0
        self._count = threading.Lock()  # the I/O thread and the caller both count
        self._remove = weakref.finalize(self, shutil.rmtree, str(self.folder), True)

    def path(self, name: str) -> Path:
        return self.folder / re.sub(r"[^A-Za-z0-9_.-]", "_", name)

    def create(self, name: str, nbytes: int) -> None:
        """A file of ``nbytes`` zero bytes (sparse until written)."""
        with open(self.path(name), "wb") as handle:
            handle.truncate(nbytes)

    def exists(self, name: str) -> bool:
        return self.path(name).exists()

    def read_into(self, name: str, out: torch.Tensor, offset: int = 0) -> None:
        """Fill ``out`` (contiguous, CPU) from the file's bytes at ``offset``."""
        if not out.is_contiguous():
            raise ValueError(f"reading {name} into a non-contiguous tensor would fill a copy; pass a contiguous one")
        view = _as_bytes(out)  # `out` is contiguous: its bytes, not a copy
        fd = os.open(self.path(name), os.O_RDONLY)
        try:
            done = 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], offset + done)
                if got <= 0:
                    raise OSError(f"{self.path(name)}: ended {done} bytes into a read of {len(view)}")
                done += got
        finally:
            os.close(fd)
        self._counted(read=len(view))

    def write_from(self, name: str, data: torch.Tensor, offset: int = 0) -> None:
        """Write ``data``'s bytes (a CPU tensor) into the file at ``offset``."""
        view = _as_bytes(data)
        fd = os.open(self.path(name), os.O_WRONLY)
        try:
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        finally:
            os.close(fd)
        self._counted(written=len(view))

    def mapped(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The file as a tensor whose writes go to the file (a shared memory map; the page cache holds it)."""
        return torch.from_file(str(self.path(name)), shared=True, size=numel, dtype=dtype)

    def _counted(self, read: int = 0, written: int = 0) -> None:
        with self._count:
            self.bytes_read += read
            self.bytes_written += written

    def remove(self) -> None:
        """Delete the folder and everything in it (also done at exit)."""
        self._remove()
