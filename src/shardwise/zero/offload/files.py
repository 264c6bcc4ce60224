"""The files one rank's offloaded state lives in: their folder under ``nvme_path`` (whose it is, swept once its
process is gone, room on the disk claimed first), and the digests of what it wrote there, checked against what it reads
back.

Why each piece is as it is (docs/offload.md, "Faults" and "Verified reads"):

* Folders: ``shardwise-<host>-ns<pid namespace>-pid<pid>-rank<r>-<random>`` (:func:`tempfile.mkdtemp`), removed
  with the engine or at exit; :func:`sweep` removes those of dead creators, as :func:`shardwise.comm.shm.sweep` does.
* Room: each rank writes its claim (``.room``) before reading the others' (:func:`claim_room`), so of any two ranks
  the later sees both.
* Files: plain ``pread``/``pwrite`` into the caller's tensors, bytes counted; a failure is :class:`OffloadIOError`.
* Digests (:class:`Sums`): one XXH3 per run written, checked by every read that covers it; a mismatch is
  :class:`OffloadChecksumError`, after which the files refuse every read, write and map.  Runs never overlap (a write
  drops those it overlaps); a map checks the runs it touches when made and suspends them until the last map is freed.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import functools
import mmap
import os
import re
import shutil
import socket
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import xxhash

from ...comm.processes import running

__all__ = [
    "CLAIM", "OPTIMIZER_KEY", "Claim", "Mismatch", "NvmeFiles", "OffloadChecksumError", "OffloadIOError", "Owner",
    "Sums", "claim_room", "claims_beside", "digest", "folder_prefix", "is_ours_to_judge", "owner_of", "sweep",
]

# ------------------------------------------------ folders: whose each is, and sweeping those of processes gone
_NAME = re.compile(r"shardwise-(?P<host>[A-Za-z0-9.-]+)-ns(?P<ns>\d+)-pid(?P<pid>\d+)-rank(?P<rank>\d+)-[A-Za-z0-9_]+")


@dataclass(frozen=True)
class Owner:
    """The process that made an offload folder, as its name says."""

    host: str
    namespace: int
    pid: int
    rank: int


@functools.lru_cache(maxsize=1)
def _host() -> str:
    """This host's name, kept to the characters a folder name may hold."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "unknown-host"


def _namespace() -> int:
    """This process's pid namespace (0 where ``/proc`` does not say: then every process shares it)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def folder_prefix(rank: int) -> str:
    """The start of this process's folder names (``mkdtemp`` adds the random part)."""
    return f"shardwise-{_host()}-ns{_namespace()}-pid{os.getpid()}-rank{rank}-"


def owner_of(name: str) -> Optional[Owner]:
    """Who made the folder called ``name``; None for a name that is not an offload folder's."""
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    return Owner(match["host"], int(match["ns"]), int(match["pid"]), int(match["rank"]))


def is_ours_to_judge(owner: Owner) -> bool:
    """Whether ``owner``'s process id can be checked from here (same host, same pid namespace)."""
    return owner.host == _host() and owner.namespace == _namespace()


def sweep(root: str) -> list[str]:
    """Remove the folders under ``root`` made on this host by this user's processes that are gone.  Returns the names
    removed.  A folder that cannot be read or removed is left alone: the sweep never makes a set-up fail.
    """
    try:
        names = os.listdir(root)
    except OSError:
        return []
    removed = []
    for name in names:
        owner = owner_of(name)
        if owner is None or not is_ours_to_judge(owner) or running(owner.pid):
            continue
        path = Path(root) / name
        try:
            if not path.is_dir() or path.is_symlink() or path.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)  # two set-ups may sweep the same folder at once
        removed.append(name)
    return removed


# ------------------------------------------------- room on the disk for every live folder
#: the file in a rank's folder that says how many bytes the rank needs there
CLAIM = ".room"  # hidden: no optimizer state kind is named so


@dataclass(frozen=True)
class Claim:
    """One live rank's folder: the bytes it needs on the disk and those it has yet to write."""

    folder: Path
    rank: int
    pid: int
    needed: int
    to_write: int


def _written(folder: Path) -> int:
    """Bytes the folder's files take on disk (sparse parts excluded, block rounding not counted)."""
    total = 0
    for entry in os.scandir(folder):
        if entry.name in (CLAIM, f"{CLAIM}.partial"):
            continue
        stat = entry.stat(follow_symlinks=False)
        total += min(stat.st_size, stat.st_blocks * 512)
    return total


def _claim_of(folder: Path, device: int) -> Claim | None:
    """The claim of ``folder`` when it is a live folder of this host on ``device`` with a claim written."""
    owner = owner_of(folder.name)
    if owner is None or not is_ours_to_judge(owner) or not running(owner.pid):
        return None
    try:
        if folder.stat().st_dev != device:
            return None
        needed = int((folder / CLAIM).read_text())
        return Claim(folder, owner.rank, owner.pid, needed, max(0, needed - _written(folder)))
    except (OSError, ValueError):
        return None  # not claimed yet, or removed meanwhile


def claims_beside(folder: Path) -> list[Claim]:
    """The claims of the live folders of this host next to ``folder`` (itself included) on its file system."""
    device = folder.stat().st_dev
    found = [_claim_of(path, device) for path in folder.parent.iterdir()]
    return sorted((c for c in found if c is not None), key=lambda c: (c.folder != folder, c.rank, c.pid))


def claim_room(folder: Path, needed: int, rank: int, what: str, key: str, label: str) -> None:
    """Claim ``needed`` bytes for ``folder``'s rank and raise when this host's ranks on the disk do not fit.  ``what``
    says what the bytes are for; ``key`` and ``label`` are the config key and the state errors name."""
    partial = folder / f"{CLAIM}.partial"
    partial.write_text(str(needed))
    os.replace(partial, folder / CLAIM)  # a reader sees the whole number or no claim
    free = shutil.disk_usage(folder).free
    claims = claims_beside(folder)
    if sum(c.to_write for c in claims) <= free:
        return
    root = str(folder.parent)
    if len(claims) <= 1:
        raise RuntimeError(
            f"rank {rank}: `{key}` {root!r} has {free:,} bytes free and this rank's {label} needs {needed:,} "
            f"({what}); free space there, point `{key}` at a larger disk, or use more ranks")
    each = "; ".join(
        f"rank {c.rank} (pid {c.pid}{', this rank: ' + what if i == 0 else ''}): {c.to_write:,} still to write"
        + (f" of {c.needed:,}" if c.to_write != c.needed else "") for i, c in enumerate(claims))
    raise RuntimeError(
        f"rank {rank}: `{key}` {root!r} has {free:,} bytes free, and the {len(claims)} ranks of this host offloading "
        f"to that disk need {sum(c.to_write for c in claims):,} bytes more there together ({each}); free space there, "
        f"give each rank its own disk (`{key}`), or spread the ranks over more hosts")


# ------------------------------------------------ the files
#: the config key errors name by default (parameter offload passes its own)
OPTIMIZER_KEY = "zero_optimization.offload_optimizer.nvme_path"


def digest(data: memoryview) -> int:
    """The 64-bit XXH3 digest of ``data`` (the GIL is released while it runs, so an I/O thread overlaps the step)."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class Mismatch:
    """Bytes ``[start, end)`` of a file do not have the digest that was recorded when they were written."""

    start: int
    end: int
    expected: int
    found: int


class _Runs:
    """One file's runs: sorted, disjoint ``(start, end, digest)``, and the ranges suspended under live maps."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.runs: list[tuple[int, int, int]] = []
        self.suspended: list[tuple[int, int]] = []
        self.maps: list[tuple[int, int]] = []

    def overlapping(self, start: int, end: int) -> list[int]:
        """Indices of the runs that overlap ``[start, end)``."""
        first = max(0, bisect.bisect_right(self.starts, start) - 1)
        found = []
        for index in range(first, len(self.runs)):
            run_start, run_end, _ = self.runs[index]
            if run_start >= end:
                break
            if run_end > start:
                found.append(index)
        return found

    def drop(self, indices: list[int]) -> list[tuple[int, int, int]]:
        dropped = [self.runs[i] for i in indices]
        for index in reversed(indices):
            del self.runs[index], self.starts[index]
        return dropped

    def add(self, start: int, end: int, value: int) -> None:
        self.drop(self.overlapping(start, end))
        at = bisect.bisect_left(self.starts, start)
        self.starts.insert(at, start)
        self.runs.insert(at, (start, end, value))

    def mapped(self, start: int, end: int) -> bool:
        """Whether a live map or a suspended range touches ``[start, end)`` (no digest may be taken there)."""
        return any(s < end and start < e for s, e in (*self.maps, *self.suspended))


def _gaps(start: int, end: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``[start, end)`` that no range of ``covered`` (sorted by start) covers."""
    gaps, at = [], start
    for lo, hi in covered:
        if lo > at:
            gaps.append((at, min(lo, end)))
        at = max(at, hi)
        if at >= end:
            break
    if at < end:
        gaps.append((at, end))
    return [(lo, hi) for lo, hi in gaps if lo < hi]


class Sums:
    """The digests of one rank's offload files, by file name (safe to use from the I/O thread and the caller)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: Optional[int] = None
        self._files: dict[str, _Runs] = {}
        #: maps freed while this thread held the lock (a collection inside it): released at the next call
        self.deferred: list[tuple[str, int, int]] = []

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None

    def held_here(self) -> bool:
        """Whether this thread is inside one of these methods (a map freed by a collection run there must wait:
        the lock is not re-entrant, and the tables are half-changed)."""
        return self._holder == threading.get_ident()

    def _runs(self, name: str) -> _Runs:
        return self._files.setdefault(name, _Runs())

    def forget(self, name: str) -> None:
        """The file is new (created, or made anew): nothing is known of it."""
        with self._locked():
            self._files.pop(name, None)

    def wrote(self, name: str, offset: int, data: memoryview) -> None:
        """``data`` was written at ``offset``: its digest replaces those of the runs it overlaps."""
        value = digest(data)
        end = offset + len(data)
        with self._locked():
            runs = self._runs(name)
            if runs.mapped(offset, end):
                runs.drop(runs.overlapping(offset, end))  # taken anew once the maps are gone
            else:
                runs.add(offset, end, value)

    def dropped(self, name: str, start: int, end: int) -> None:
        """A write of ``[start, end)`` failed part-way: what the runs it overlaps hold is not known."""
        with self._locked():
            runs = self._runs(name)
            runs.drop(runs.overlapping(start, end))

    def check(self, name: str, offset: int, data: memoryview, fill: bool = True) -> Optional[Mismatch]:
        """``data`` was read at ``offset``: the first run inside it whose bytes changed, or None.  With ``fill``, bytes
        with no digest get one now (unless a map may write them)."""
        end = offset + len(data)
        with self._locked():
            runs = self._runs(name)
            touching = [runs.runs[i] for i in runs.overlapping(offset, end)]
            blocked = [*runs.maps, *runs.suspended]
        for start, stop, expected in touching:
            if offset <= start and stop <= end:
                found = digest(data[start - offset : stop - offset])
                if found != expected:
                    return Mismatch(start, stop, expected, found)
        if not fill:
            return None
        covered = sorted([(s, e) for s, e, _ in touching] + blocked)
        fresh = [(lo, hi, digest(data[lo - offset : hi - offset])) for lo, hi in _gaps(offset, end, covered)]
        with self._locked():
            runs = self._runs(name)
            for lo, hi, value in fresh:
                if not runs.overlapping(lo, hi) and not runs.mapped(lo, hi):  # (nothing wrote there meanwhile)
                    runs.add(lo, hi, value)
        return None

    def span(self, name: str, start: int, end: int) -> tuple[int, int]:
        """``[start, end)`` grown to the runs it touches: what a map must cover to check them."""
        with self._locked():
            runs = self._runs(name)
            touching = [runs.runs[i] for i in runs.overlapping(start, end)]
        return min([start, *(s for s, _, _ in touching)]), max([end, *(e for _, e, _ in touching)])

    def suspend(self, name: str, start: int, end: int) -> None:
        """A map of ``[start, end)`` (checked already) is handed out: its runs' digests wait for its end."""
        with self._locked():
            runs = self._runs(name)
            dropped = runs.drop(runs.overlapping(start, end))
            known = sorted([(s, e) for s, e, _ in dropped] + runs.suspended)
            runs.suspended = sorted(runs.suspended + [(s, e) for s, e, _ in dropped] + _gaps(start, end, known))
            runs.maps.append((start, end))

    def released(self, name: str, start: int, end: int) -> list[tuple[int, int]]:
        """The map of ``[start, end)`` is gone: the suspended ranges no live map touches any more (the caller
        sums them from the file and :meth:`resumed` each)."""
        with self._locked():
            runs = self._files.get(name)
            if runs is None or (start, end) not in runs.maps:
                return []
            runs.maps.remove((start, end))
            free = [(s, e) for s, e in runs.suspended if not any(s < me and ms < e for ms, me in runs.maps)]
            runs.suspended = [r for r in runs.suspended if r not in free]
            return free

    def resumed(self, name: str, start: int, end: int, value: Optional[int]) -> None:
        """The suspended range ``[start, end)`` holds bytes of digest ``value`` now (None: they could not be read)."""
        with self._locked():
            runs = self._files.get(name)
            if runs is not None and value is not None and not runs.mapped(start, end):
                runs.add(start, end, value)


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
        return type(self)(f"{self}. {more}", rank=self.rank, path=self.path, operation=self.operation, error=self.errno)


class OffloadChecksumError(OffloadIOError):
    """Bytes read back from an offload file are not those this rank wrote there (their digest differs).

    Once raised, the files refuse every later read, write and map with it (``errno`` is None)."""


def _remove_if_creator(folder: str, creator: int) -> None:
    """Remove ``folder`` unless this is a forked child of its creator (whose exit must not take the parent's)."""
    if os.getpid() == creator:
        shutil.rmtree(folder, ignore_errors=True)


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().data


class _CutShort(OSError):
    """A file holds fewer bytes than this rank wrote there."""


def _unmapped(ref: "weakref.ref[NvmeFiles]", name: str, start: int, end: int) -> None:
    """A map of ``[start, end)`` was freed: the digests it suspended are taken anew once no map holds them."""
    files = ref()
    if files is not None:
        files.unmapped(name, start, end)


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


#: what the error that made the files refuse every later use adds
_REFUSING = ("These files no longer hold this rank's state: this engine now refuses to step or save; restart from "
             "the last checkpoint (a new engine and `load_checkpoint`); `engine.destroy(restore_params=False)` lets "
             "this one go without reading them")


class NvmeFiles:
    """Named files of raw tensor bytes in this rank's own folder under ``root``.

    ``key`` (the config key of ``root``) and ``label`` (what the files hold) are what errors name."""

    def __init__(self, root: str, rank: int, key: str = OPTIMIZER_KEY, label: str = "offloaded optimizer state") -> None:
        self.rank, self.key, self.label = rank, key, label
        try:
            os.makedirs(root, exist_ok=True)
            sweep(root)  # folders of killed processes of this host: their state is lost already
            self.folder = Path(tempfile.mkdtemp(prefix=folder_prefix(rank), dir=root))
        except OSError as exc:
            raise RuntimeError(f"rank {rank}: cannot make this rank's offload folder under `{key}` {root!r} ({exc}); "
                               f"set `{key}` to a writable directory") from exc
        self.bytes_read, self.bytes_written = 0, 0
        self._count = threading.Lock()  # the I/O thread and the caller both count
        self._remove = weakref.finalize(self, _remove_if_creator, str(self.folder), os.getpid())
        #: the digests of what this rank wrote, checked against what it reads
        self.sums = Sums()
        #: the first error that says the files lost this rank's state (bytes changed, the file cut short or
        #: removed): every later read, write or map raises it, so nothing read wrong is trained on or saved
        self.failed: Optional[OffloadIOError] = None

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
            error = OffloadIOError(
                f"rank {self.rank}: {self.label}: {operation} {place}{self.path(name)}{context} "
                f"failed: {cause}; {_fix(exc, self.key)}", rank=self.rank, path=str(self.path(name)), operation=operation,
                error=code)
            raise (self._lost(error) if isinstance(exc, _CutShort) or code == errno.ENOENT else error) from exc

    def _mismatch(self, name: str, offset: int, nbytes: int, where: str, bad: Mismatch) -> OffloadIOError:
        context = f" ({where})" if where else ""
        return self._lost(OffloadChecksumError(
            f"rank {self.rank}: {self.label}: reading {nbytes:,} bytes at byte {offset:,} of {self.path(name)}{context} "
            f"found bytes {bad.start:,}-{bad.end:,} changed since this rank wrote them (their digest is "
            f"{bad.found:016x}, {bad.expected:016x} was written): another process wrote into the file, or the disk "
            "or memory corrupted it; check the disk (`dmesg`, `smartctl`) and that nothing else writes there. "
            "Nothing read from it was used", rank=self.rank, path=str(self.path(name)), operation="reading",
            error=None))

    def _lost(self, error: OffloadIOError) -> OffloadIOError:
        """``error`` says the files no longer hold this rank's state: from now on they refuse every use."""
        self.failed = error.extended(_REFUSING)
        return self.failed

    def unmapped(self, name: str, start: int, end: int) -> None:
        """A map of ``[start, end)`` was freed: the digests it suspended are taken anew once no map holds them (at
        the next call, when it was freed by a collection inside this thread's use of the digests)."""
        sums = self.sums
        if sums.held_here():
            sums.deferred.append((name, start, end))
            return
        if self.failed is None:
            for low, high in sums.released(name, start, end):
                sums.resumed(name, low, high, self.digest_of(name, low, high))

    def check_usable(self) -> None:
        """Raise once the files lost this rank's state (:attr:`failed`): what they hold must not be used again."""
        while self.sums.deferred:
            self.unmapped(*self.sums.deferred.pop())
        if self.failed is not None:
            raise self.failed.extended("(Found earlier; these files are not read or written since)")

    def create(self, name: str, nbytes: int) -> None:
        """A file of ``nbytes`` zero bytes (sparse until written)."""
        self.check_usable()
        with self._failing("creating", name, 0, nbytes, ""), open(self.path(name), "wb") as handle:
            handle.truncate(nbytes)
        self.sums.forget(name)

    def exists(self, name: str) -> bool:
        return self.path(name).exists()

    def read_into(self, name: str, out: torch.Tensor, offset: int = 0, where: str = "") -> None:
        """Fill ``out`` (contiguous, CPU) from the file's bytes at ``offset``; ``where`` is named in errors."""
        if not out.is_contiguous():
            raise ValueError(f"reading {name} into a non-contiguous tensor would fill a copy; pass a contiguous one")
        self.check_usable()
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
        bad = self.sums.check(name, offset, view)
        if bad is not None:
            raise self._mismatch(name, offset, len(view), where, bad)

    def write_from(self, name: str, data: torch.Tensor, offset: int = 0, where: str = "") -> None:
        """Write ``data``'s bytes (a CPU tensor) into the file at ``offset``; ``where`` is named in errors."""
        self.check_usable()
        view = _as_bytes(data)
        try:
            with self._failing("writing", name, offset, len(view), where):
                self._write(name, view, offset)
        except OffloadIOError:
            self.sums.dropped(name, offset, offset + len(view))  # part of it may have reached the file
            raise
        self.sums.wrote(name, offset, view)
        self._counted(written=len(view))

    def _write(self, name: str, view: memoryview, offset: int) -> None:
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

    def mapped_range(self, name: str, start: int, numel: int, dtype: torch.dtype,
                     where: Callable[[int], str] = lambda byte: "") -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the file as a tensor whose writes go to the file.

        Maps only the pages holding them (a whole-file map per piece of a checkpoint would map the file
        once per parameter), and those of the runs of bytes written at once that they touch, whose digests
        are checked here; those wait for the map to be freed, then are taken anew (:class:`Sums`).
        ``where(byte)`` says in words what holds that byte of the file, for errors."""
        if numel == 0:
            return torch.zeros(0, dtype=dtype)
        self.check_usable()
        first, nbytes = start * dtype.itemsize, numel * dtype.itemsize
        low, high = self.sums.span(name, first, first + nbytes)
        base = low - low % mmap.ALLOCATIONGRANULARITY  # a map starts at a page boundary
        with self._failing("mapping", name, first, nbytes, ""):
            region = self._map(name, base, high - base, os.O_RDWR)
        bad = self.sums.check(name, low, memoryview(region)[low - base :], fill=False)
        if bad is not None:
            raise self._mismatch(name, low, high - low, where(bad.start), bad)  # (the map closes as it is freed)
        self.sums.suspend(name, low, high)
        weakref.finalize(region, _unmapped, weakref.ref(self), name, low, high)
        # the tensor keeps the map alive; the map closes when the last view of it goes
        return torch.frombuffer(region, dtype=torch.uint8)[first - base : first - base + nbytes].view(dtype)

    def _map(self, name: str, base: int, length: int, flags: int) -> mmap.mmap:
        fd = os.open(self.path(name), flags)
        try:
            size = os.fstat(fd).st_size  # checked: a page past the end would be SIGBUS, not an error
            if size < base + length:
                raise _CutShort(errno.EIO, f"the file holds {size:,} bytes, fewer than the {base + length:,} it should")
            access = mmap.ACCESS_WRITE if flags == os.O_RDWR else mmap.ACCESS_READ
            return mmap.mmap(fd, length, offset=base, access=access)
        finally:
            os.close(fd)

    def digest_of(self, name: str, start: int, end: int) -> Optional[int]:
        """The digest of bytes ``[start, end)`` of the file as it is now (None where it cannot be read)."""
        base = start - start % mmap.ALLOCATIONGRANULARITY
        try:
            region = self._map(name, base, end - base, os.O_RDONLY)
        except (OSError, ValueError):
            return None
        return digest(memoryview(region)[start - base :])  # (the map closes as it is freed, right after)

    def _counted(self, read: int = 0, written: int = 0) -> None:
        with self._count:
            self.bytes_read += read
            self.bytes_written += written

    def remove(self) -> None:
        """Delete the folder and everything in it (also done at exit)."""
        self._remove()
