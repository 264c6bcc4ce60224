"""Checkpoint faults: damaged files are refused by name, a full or unwritable disk fails every rank cleanly.

* A checkpoint's files carry their size and SHA-256 in the manifest: a flipped
  byte in a tensor file, the index or a rank file, or a cut tensor file, makes
  the load fail on every rank naming the file, and leaves the engine as it was.
  (Without checksums a flipped byte in tensor data, or a digit changed in a rank
  file's RNG state, loaded silently.)
* A save that cannot write (a full disk injected on one rank while it writes
  its shard, or on rank 0 while it writes the index; a directory that may not
  be written) raises a `CheckpointError` naming the cause on every rank, and
  leaves `latest` and the previous checkpoint loadable, with no temporary
  directory behind.
* A rank that skips `save_checkpoint` (`if rank == 0:`) and trains on makes
  every rank raise a `CollectiveMismatchError` at once naming both calls (its
  backward announces itself to the save), writing nothing; the ranks realign.
* `checkpoint.async_save: true` is refused (it used to be accepted and ignored).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from _faults_common import VICTIM, bounded_outcome, make_engine, outcome, record_row, train_step
from torch.distributed.checkpoint.filesystem import FileSystem

import shardwise
from shardwise.checkpoint import CheckpointError
from shardwise.testing import distributed_test, run_distributed, run_subtests

TAG = "good"


def _snapshot(engine: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for group in engine.optimizer.inner.param_groups for p in group["params"]]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------ damaged files
def _flip(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x01
    path.write_bytes(bytes(data))


def _change_a_digit(path: Path) -> None:
    """A rank file still valid JSON, with one digit of its RNG state changed."""
    text = path.read_text()
    index = next(i for i in range(len(text) // 2, len(text)) if text[i] in "12345678")
    path.write_text(text[:index] + str(int(text[index]) + 1) + text[index + 1 :])


def _truncate(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 100)


DAMAGE = {
    "a flipped byte in a tensor file": ("__1_0.distcp", _flip),
    "a cut tensor file (100 bytes short)": ("__0_0.distcp", _truncate),
    "a flipped byte in the tensor index": (".metadata", _flip),
    "a changed digit in a rank file's RNG state": ("rank1.json", _change_a_digit),
}


def _damaged_load_is_refused(root: str, case: str) -> None:
    engine = make_engine(2)
    for step in range(2):
        train_step(engine, step)
    engine.save_checkpoint(root, tag=TAG)
    name, damage = DAMAGE[case]
    copy = Path(root + "-damaged")
    if dist.get_rank() == 0:
        shutil.copytree(root, copy)
        damage(copy / TAG / name)
    dist.barrier()
    train_step(engine, 2)
    before = _snapshot(engine)
    with pytest.raises(CheckpointError) as info:
        engine.load_checkpoint(str(copy), tag=TAG)
    message = str(info.value)
    assert str(copy / TAG) in message and name in message, message  # the file, by its checkpoint and name
    assert _same(before, _snapshot(engine)), "a refused load changed the engine"
    engine.load_checkpoint(root, tag=TAG)  # the undamaged original still loads
    engine.destroy()


@distributed_test(world_size=2, timeout=180)
def test_damaged_files_are_refused_by_name(tmp_path: Path) -> None:
    run_subtests(_damaged_load_is_refused, [{"root": str(tmp_path / f"c{i}"), "case": case}
                                            for i, case in enumerate(DAMAGE)])
    if dist.get_rank() == 0:
        for case, (name, _) in DAMAGE.items():
            record_row("checkpoint", f"{case} (`{name}`)", "2",
                       "`load_checkpoint` raises `CheckpointError` on every rank naming the file; the engine is "
                       "unchanged", None)


# ------------------------------------------------------------------ failed writes
class _FullDisk:
    """A file whose writes fail with ENOSPC once ``room`` bytes are in."""

    def __init__(self, stream: Any, room: int, name: str) -> None:
        self.stream, self.room, self.name = stream, room, name

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size > self.room:
            raise OSError(errno.ENOSPC, "No space left on device", self.name)
        self.room -= size
        written: int = self.stream.write(data)
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextlib.contextmanager
def _fill_disk(match: str, report: bool) -> Iterator[None]:
    """Inside, the disk is full: DCP's writes to files whose name contains ``match`` fail after 64 bytes
    (with ENOSPC), and with ``report`` the file system says 64 bytes are free."""
    original, usage = FileSystem.create_stream, shutil.disk_usage

    @contextlib.contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        with original(self, path, mode) as stream:
            yield _FullDisk(stream, 64, str(path)) if "w" in mode and match in Path(path).name else stream

    FileSystem.create_stream = create_stream  # type: ignore[method-assign]
    if report:
        shutil.disk_usage = lambda path: usage(path)._replace(free=64)  # type: ignore[assignment]
    try:
        yield
    finally:
        FileSystem.create_stream = original  # type: ignore[method-assign]
        shutil.disk_usage = usage


@contextlib.contextmanager
def _deny_temp_dirs() -> Iterator[None]:
    """Inside, creating a save's temporary directory is refused (EACCES), as in a read-only mount."""
    original = Path.mkdir

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.name.startswith(".tmp-"):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        original(self, *args, **kwargs)

    Path.mkdir = mkdir  # type: ignore[method-assign]
    try:
        yield
    finally:
        Path.mkdir = original  # type: ignore[method-assign]


FAILURES = {
    # found before writing: the file system reports less free space than the shard needs
    "the disk is full when rank 1 writes its tensor file": (VICTIM, lambda: _fill_disk(".distcp", True),
                                                            "the file system is full"),
    # found while writing: the index's write fails with ENOSPC
    "the disk fills while rank 0 writes the tensor index": (0, lambda: _fill_disk(".metadata", False),
                                                            "the file system is full"),
    "the save directory may not be written": (0, _deny_temp_dirs, "this process may not write there"),
}


def _failed_save_keeps_the_previous(root: str, case: str) -> dict[str, Any]:
    engine = make_engine(1)
    train_step(engine, 0)
    engine.save_checkpoint(root, tag=TAG)
    saved = _snapshot(engine)
    train_step(engine, 1)
    who, inject, cause = FAILURES[case]
    start = time.monotonic()
    with inject() if dist.get_rank() == who else contextlib.nullcontext():
        with pytest.raises(CheckpointError, match=cause) as info:
            engine.save_checkpoint(root, tag="next")
    seconds = time.monotonic() - start
    assert "the previous checkpoint and `latest` are unchanged" in str(info.value) or who != dist.get_rank(), info.value
    dist.barrier()
    assert (Path(root) / "latest").read_text() == TAG
    assert not (Path(root) / "next").exists() and not list(Path(root).glob(".tmp-*")), sorted(Path(root).iterdir())
    engine.load_checkpoint(root)  # `latest`: the previous checkpoint, whole
    assert _same(saved, _snapshot(engine)), "the previous checkpoint did not load back exactly"
    engine.destroy()
    return {"seconds": seconds}


def _failed_saves(root: str) -> list[float]:
    times = []
    for index, case in enumerate(FAILURES):
        times.append(_failed_save_keeps_the_previous(f"{root}{index}", case)["seconds"])
    return times


@distributed_test(world_size=2, timeout=180)
def test_a_full_or_unwritable_disk_fails_every_rank_and_keeps_latest(tmp_path: Path) -> None:
    times = _failed_saves(str(tmp_path / "save"))
    if dist.get_rank() == 0:
        for (case, (who, _, cause)), seconds in zip(FAILURES.items(), times):
            record_row("checkpoint", f"{case} (injected on rank {who})", "1",
                       f"`save_checkpoint` raises `CheckpointError` on every rank (\"{cause}\"); `latest` and the "
                       "previous checkpoint untouched, no temporary directory left", seconds)


# ------------------------------------------------------------------ a rank skips the save
SAVE_TIMEOUT = 2.0
#: scheduling noise on a busy 2-core machine; a save that is not refused at once is reported after this
SAVE_SLACK = 10.0


def _lonely_save(engine: Any, root: str, skipper: int, step: int) -> dict[str, Any]:
    """Every rank but ``skipper`` saves; ``skipper`` goes on to its next step, whose backward announces itself
    to the savers' `save_checkpoint`."""
    if dist.get_rank() == skipper:
        return outcome(functools.partial(train_step, engine, step))
    result = bounded_outcome(lambda: engine.save_checkpoint(root, tag=f"lonely{skipper}"), SAVE_TIMEOUT + SAVE_SLACK)
    result["written"] = (Path(root) / f"lonely{skipper}").exists()
    return result


def _skip_save(root: str) -> dict[str, Any]:
    engine = make_engine(1, comms={"timeout": SAVE_TIMEOUT + SAVE_SLACK}, checkpoint={"timeout": SAVE_TIMEOUT})
    train_step(engine, 0)
    results: dict[str, Any] = {}
    for step, skipper in enumerate((VICTIM, 0), start=1):
        results[f"skipper {skipper}"] = saved = _lonely_save(engine, root, skipper, step)
        if saved["error"] == "still waiting":
            return results  # the save never returns: report it now (leaving the stuck thread behind)
        # every rank caught its error, and nothing moved: the step again, together
        results[f"step after skipper {skipper}"] = stepped = outcome(functools.partial(train_step, engine, step))
        if stepped["error"] is not None:
            return results  # the other rank gave up: nothing more to do together
    results["together"] = outcome(lambda: engine.save_checkpoint(root, tag="together"))
    latest = Path(root) / "latest"
    results["latest"] = latest.read_text() if latest.exists() else None
    engine.destroy()
    return results


def test_a_rank_that_skips_save_makes_every_rank_raise_at_once(tmp_path: Path) -> None:
    """`if rank == 0: engine.save_checkpoint(...)`, the other rank training on: its backward announces itself to
    the save, and every rank raises `CollectiveMismatchError` at once naming both calls; nothing is written;
    the ranks realign (the step again, then a save together)."""
    results = run_distributed(_skip_save, 2, args=(str(tmp_path / "save"),), timeout=90)
    for rank, result in enumerate(results):
        for skipper in (VICTIM, 0):
            saver = 1 - skipper
            outcome_here = result[f"skipper {skipper}"]
            assert outcome_here["error"] != "still waiting", (
                f"rank {rank}: `save_checkpoint` without rank {skipper} was still waiting after "
                f"{outcome_here['seconds']:g} s")
            assert outcome_here["error"] == "CollectiveMismatchError", f"rank {rank}, rank {skipper} skipped: {result}"
            message = outcome_here["message"]
            assert f"rank {saver} is in `save_checkpoint` of engine" in message, message
            assert f"rank {skipper} is in `backward` of engine" in message and "if rank == 0" in message, message
            assert outcome_here["seconds"] < SAVE_TIMEOUT, outcome_here
            if rank == saver:
                assert not outcome_here["written"], f"rank {rank}: a save without rank {skipper} left a directory"
            assert result[f"step after skipper {skipper}"]["error"] is None, result
        assert result["together"]["error"] is None and result["latest"] == "together", result
    seconds = max(r[f"skipper {VICTIM}"]["seconds"] for r in results)
    record_row("checkpoint", "rank 1 skips `save_checkpoint` (`if rank == 0:`) and trains on", "1",
               "every rank raises `CollectiveMismatchError` at once, naming `save_checkpoint` on rank 0 and "
               "`backward` on rank 1; nothing written; the ranks realign (the step again, then a save together, "
               "work)", seconds)


def test_async_save_is_refused() -> None:
    with pytest.raises(shardwise.ConfigError, match="checkpoint.async_save"):
        shardwise.Config.load({"checkpoint": {"async_save": True}})
    assert shardwise.Config.load({"checkpoint": {"async_save": False}}).checkpoint.async_save is False
    record_row("checkpoint", "`checkpoint.async_save: true`", "all",
               "a `ConfigError` at load: checkpoints are written synchronously (it used to be accepted and ignored)",
               None)
