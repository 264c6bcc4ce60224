"""The files one rank's offloaded optimizer state lives in (``offload_optimizer: {device: nvme}``).

Each rank of each engine makes its own folder under ``nvme_path`` with
:func:`tempfile.mkdtemp` (a unique name, created atomically, that names the
host and process: :mod:`.nvme_folder`), so two jobs or two engines pointing at
the same ``nvme_path`` never share a file.  The folder is removed when the
engine is destroyed and, failing that, when the process exits
(``weakref.finalize`` runs at exit); a killed process's folder is removed by
the next set-up on the host (:func:`.nvme_folder.sweep`).

Reads and writes are plain ``pread``/``pwrite`` into and out of tensors the
caller owns, so host memory holds only what the caller preallocated.  The bytes
moved are counted for the measurement in docs/offload.md.  Every failing
operation raises :class:`OffloadIOError` naming the rank, the file, the
operation, where in the file, the caller's context and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import shutil
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Iterator

import torch

from .nvme_folder import folder_prefix, sweep
from .nvme_room import claim_room

__all__ = ["OPTIMIZER_KEY", "NvmeFiles", "OffloadIOError"]

#: the config key errors name by default (parameter offload passes its own)
OPTIMIZER_KEY = "zero_optimization.offload_optimizer.nvme_path"


class OffloadIOError(RuntimeError):
    """A read or write of offloaded state failed; the message names the rank, file, operation and fix.

    ``errno`` is the operating system's error number (``errno.ENOSPC``, ...), ``path`` the file and
    ``operation`` what was done (``"reading"``, ``"writing"``, ``"creating"``, ``"mapping"``).
    """

    def __init__(self, message: str, *, rank: int, path: str, operation: str, error: int | None) -> None:
        super().__init__(message)
        self.rank, self.path, self.operation, self.errno = rank, path, operation, error

    def extended(self, more: str) -> OffloadIOError:
        """The same error with ``more`` said after its message (what the caller's state is now)."""
        return OffloadIOError(f"{self}. {more}", rank=self.rank, path=self.path, operation=self.operation,
                              error=self.errno)


def _make_folder(root: str, rank: int, key: str) -> Path:
    try:
        os.makedirs(root, exist_ok=True)
        sweep(root)  # folders of killed processes of this host: their state is lost already
        return Path(tempfile.mkdtemp(prefix=folder_prefix(rank), dir=root))
    except OSError as exc:
        raise RuntimeError(
            f"rank {rank}: cannot make this rank's offload folder under `{key}` {root!r} ({exc}); "
            f"set `{key}` to a writable directory") from exc


def _remove_if_creator(folder: str, creator: int) -> None:
    """Remove ``folder`` unless this is a forked child of its creator (whose exit must not take the parent's)."""
    if os.getpid() == creator:
        shutil.rmtree(folder, ignore_errors=True)


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().data


class _CutShort(OSError):
    """A file holds fewer bytes than this rank wrote there."""


def _check_size(size: int, needed: int) -> None:
    if size < needed:
        raise _CutShort(errno.EIO, f"the file holds {size:,} bytes, fewer than the {needed:,} it should")


def _fix(exc: OSError, key: str) -> str:
    """What probably happened, and what to do, for an I/O error."""
    error = exc.errno
    if isinstance(exc, _CutShort):
        return ("the file was cut short while the job used it (another process or a clean-up wrote to it): keep "
                f"other processes and clean-up jobs out of the folders under `{key}` while a job runs")
    if error in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk under `{key}` is full: free space there or point `{key}` at a larger disk"
    if error == errno.ENOENT:
        return ("the file was removed while the job used it (a clean-up of the folder, or another process): keep "
                f"other processes and clean-up jobs out of the folders under `{key}` while a job runs")
    if error in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "the file may no longer be written (its permissions changed, or the disk was remounted read-only)"
    return f"the disk reported an error: check its health (`dmesg`, `smartctl`) or point `{key}` at another disk"


class NvmeFiles:
    """Named files of raw tensor bytes in this rank's own folder under ``root``.

    ``key`` (the config key of ``root``) and ``label`` (what the files hold) are what errors name."""

    def __init__(self, root: str, rank: int, key: str = OPTIMIZER_KEY, label: str = "offloaded optimizer state") -> None:
        self.rank, self.key, self.label = rank, key, label
        self.folder = _make_folder(root, rank, key)
        self.bytes_read = 0
        self.bytes_written = 0
        self._count = threading.Lock()  # the I/O thread and the caller both count
        self._remove = weakref.finalize(self, _remove_if_creator, str(self.folder), os.getpid())

    def path(self, name: str) -> Path:
        return self.folder / re.sub(r"[^A-Za-z0-9_.-]", "_", name)

    def reserve(self, needed: int, what: str) -> None:
        """Claim ``needed`` bytes on the disk; raise when this host's ranks using it need more than is free (the
        folder removed first: a refused set-up leaves nothing behind)."""
        try:
            claim_room(self.folder, needed, self.rank, what, self.key, self.label)
        except RuntimeError:
            self.remove()
            raise

    @contextlib.contextmanager
    def _failing(self, operation: str, name: str, offset: int, nbytes: int, where: str) -> Iterator[None]:
        """Turn an ``OSError`` of one operation into an :class:`OffloadIOError` that says all about it."""
        try:
            yield
        except OSError as exc:
            code = exc.errno
            cause = f"{errno.errorcode.get(code, 'error')} ({exc.strerror or exc})" if code else str(exc)
            place = f"{nbytes:,} bytes at byte {offset:,} of " if nbytes else ""
            context = f" ({where})" if where else ""
            raise OffloadIOError(
                f"rank {self.rank}: {self.label}: {operation} {place}{self.path(name)}{context} "
                f"failed: {cause}; {_fix(exc, self.key)}", rank=self.rank, path=str(self.path(name)), operation=operation,
                error=code) from exc

    def create(self, name: str, nbytes: int) -> None:
        """A file of ``nbytes`` zero bytes (sparse until written)."""
        with self._failing("creating", name, 0, nbytes, ""), open(self.path(name), "wb") as handle:
            handle.truncate(nbytes)

    def exists(self, name: str) -> bool:
        return self.path(name).exists()

    def read_into(self, name: str, out: torch.Tensor, offset: int = 0, where: str = "") -> None:
        """Fill ``out`` (contiguous, CPU) from the file's bytes at ``offset``; ``where`` is named in errors."""
        if not out.is_contiguous():
            raise ValueError(f"reading {name} into a non-contiguous tensor would fill a copy; pass a contiguous one")
        view = _as_bytes(out)  # `out` is contiguous: its bytes, not a copy
        with self._failing("reading", name, offset, len(view), where):
            fd = os.open(self.path(name), os.O_RDONLY)
            try:
                done = 0
                while done < len(view):
                    got = os.preadv(fd, [view[done:]], offset + done)
                    if got <= 0:
                        raise _CutShort(errno.EIO, f"the file ended {done:,} bytes into the read")
                    done += got
            finally:
                os.close(fd)
        self._counted(read=len(view))

    def write_from(self, name: str, data: torch.Tensor, offset: int = 0, where: str = "") -> None:
        """Write ``data``'s bytes (a CPU tensor) into the file at ``offset``; ``where`` is named in errors."""
        view = _as_bytes(data)
        with self._failing("writing", name, offset, len(view), where):
            fd = os.open(self.path(name), os.O_WRONLY)
            try:
                done = 0
                while done < len(view):
                    wrote = os.pwrite(fd, view[done:], offset + done)
                    if wrote <= 0:  # a regular file never does this; looping on it would hang the step
                        raise OSError(errno.EIO, f"the write stopped {done:,} bytes in")
                    done += wrote
            finally:
                os.close(fd)
        self._counted(written=len(view))

    def mapped(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The file as a tensor whose writes go to the file (a shared memory map; the page cache holds it)."""
        with self._failing("mapping", name, 0, numel * dtype.itemsize, ""):
            # torch would grow a short file with zeros (state silently lost) and not name a missing one
            _check_size(os.stat(self.path(name)).st_size, numel * dtype.itemsize)
            return torch.from_file(str(self.path(name)), shared=True, size=numel, dtype=dtype)

    def mapped_range(self, name: str, start: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the file as a tensor whose writes go to the file.

        Maps only the pages holding them (a whole-file map per piece of a checkpoint would map the file
        once per parameter)."""
        if numel == 0:
            return torch.zeros(0, dtype=dtype)
        first = start * dtype.itemsize
        base = first - first % mmap.ALLOCATIONGRANULARITY  # a map starts at a page boundary
        length = first - base + numel * dtype.itemsize
        with self._failing("mapping", name, first, numel * dtype.itemsize, ""):
            fd = os.open(self.path(name), os.O_RDWR)
            try:
                _check_size(os.fstat(fd).st_size, base + length)  # a page past the end would be SIGBUS, not an error
                region = mmap.mmap(fd, length, offset=base)
            finally:
                os.close(fd)
        # the tensor keeps the map alive; the map closes when the last view of it goes
        return torch.frombuffer(region, dtype=torch.uint8)[first - base :].view(dtype)

    def _counted(self, read: int = 0, written: int = 0) -> None:
        with self._count:
            self.bytes_read += read
            self.bytes_written += written

    def remove(self) -> None:
        """Delete the folder and everything in it (also done at exit)."""
        self._remove()
