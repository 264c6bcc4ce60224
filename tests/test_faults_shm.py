"""No shared-memory segment file outlives a failed set-up: a rank raises or is killed at each set-up point.

Shared memory is set up by two collective steps (``shardwise.comm.shm``): opening the
group's segment (rank 0 creates a file, broadcasts its name, every rank maps it,
all vote) and allocating a buffer every rank maps (each rank creates a file, the
names are exchanged, every rank maps every file, all vote).  A rank that leaves
at any of these points (raises, or is killed with SIGKILL, whose clean-up never
runs) must leave no ``/dev/shm/shardwise-<pid>-*`` file of any rank of the job
behind.  Files are counted by the pids of this launch's ranks, so other jobs on
the host do not disturb the count.

One launch runs every "raises" case, each on a fresh two-rank group (a group
whose collective timed out is not used again); a kill ends a process, so each
kill is a launch of its own.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from _faults_common import die, record_row

from shardwise.comm import shm
from shardwise.comm.distributed import Comm
from shardwise.testing import run_distributed

#: seconds a set-up collective waits for a rank that left (the survivor's time to error)
TIMEOUT = 1.0
#: elements of the buffer the allocation cases ask for (its file: 4 KiB header + 256 KiB)
NUMEL = 1 << 16
#: set-up points: the `shm.SharedMemory` method (or shm function) a rank leaves at, and which set-up step it is in
OPEN_POINTS = ("_share", "_attach", "_agree")
ALLOCATE_POINTS = ("_exchange", "_attach", "_agree")


class Left(Exception):
    """What a rank raises to leave the set-up at a chosen point."""


def segment_files(pids: list[int]) -> list[str]:
    """The segment files in /dev/shm made by the processes ``pids`` (shm names them after their creator)."""
    prefixes = tuple(f"shardwise-{pid}-" for pid in pids)
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefixes))


def _arm(point: str, leave: Callable[[], None]) -> Callable[[], None]:
    """Make this rank ``leave`` when it reaches ``point``; returns the undo."""
    if point == "_attach":
        original: Any = shm._attach

        def attach(offer: bytes, size: int) -> Any:
            mapped = original(offer, size)  # mapped, then leaves: the file must still go
            leave()
            return mapped

        shm._attach = attach
        return lambda: setattr(shm, "_attach", original)

    method = getattr(shm.SharedMemory, point)

    def left(self: shm.SharedMemory, *args: Any) -> Any:
        leave()

    setattr(shm.SharedMemory, point, left)
    return lambda: setattr(shm.SharedMemory, point, method)


def _raise() -> None:
    raise Left("this rank leaves the set-up")


def _set_up(step: str, comm: Comm) -> None:
    if step == "open":
        comm.open_shared_memory()
    else:
        comm.shm.zeros(NUMEL, torch.float32, torch.device("cpu"))


def _timed_set_up(step: str, comm: Comm) -> dict[str, Any]:
    """Run the set-up step; the error's class name (or "none") and how long it took."""
    start = time.monotonic()
    try:
        _set_up(step, comm)
        error = "none"
    except Exception as exc:  # noqa: BLE001 - reported, the test decides
        error = type(exc).__name__
    return {"error": error, "seconds": time.monotonic() - start}


def _one_case(step: str, point: str, victim: int) -> dict[str, Any]:
    comm = Comm(dist.new_group([0, 1]), timeout=TIMEOUT)
    dist.barrier()  # both ranks start each step together: only the rank that leaves makes a collective wait
    if step == "allocate":
        comm.open_shared_memory()
        assert comm.shm.active, comm.transport
        dist.barrier()
    undo = _arm(point, _raise) if dist.get_rank() == victim else (lambda: None)
    try:
        return _timed_set_up(step, comm)
    finally:
        undo()


def _every_raise() -> dict[str, Any]:
    pids: list[Any] = [None, None]
    dist.all_gather_object(pids, os.getpid())
    cases: dict[str, Any] = {}
    for victim in (0, 1):
        for step, points in (("open", OPEN_POINTS), ("allocate", ALLOCATE_POINTS)):
            for point in points:
                result = _one_case(step, point, victim)
                dist.barrier()  # both ranks are out of the case: every file of it should be gone
                result["left"] = segment_files(pids)
                cases[f"rank {victim} raises at {step} {point}"] = result
    return cases


def test_a_rank_that_raises_at_any_set_up_point_leaves_no_file() -> None:
    survivor_of = {0: 1, 1: 0}
    per_rank = run_distributed(_every_raise, 2, timeout=120)
    seconds = []
    for rank, cases in enumerate(per_rank):
        for name, result in cases.items():
            assert result["left"] == [], (rank, name, result)
            victim = int(name.split()[1])
            want = ("Left",) if rank == victim else ("CommError", "CollectiveMismatchError")
            assert result["error"] in want, (rank, name, result)  # the survivor's set-up fails, named
            if rank == survivor_of[victim]:
                seconds.append(result["seconds"])
    assert len(seconds) == 2 * (len(OPEN_POINTS) + len(ALLOCATE_POINTS))
    record_row("death", "a rank raises at any point of shared-memory set-up (open a segment, allocate a shared "
               "buffer: before the name is shared, while mapping, at the vote)", "0-3",
               f"the other rank raises `CommError` after `comms.timeout` ({TIMEOUT:g} s here); no `/dev/shm` "
               "file of the job is left", max(seconds))


def _killed_at(step: str, point: str, victim: int) -> dict[str, Any]:
    pids: list[Any] = [None, None]
    dist.all_gather_object(pids, os.getpid())
    comm = Comm(None, timeout=TIMEOUT * 10)  # a killed peer is seen at once (its socket closes)
    if step == "allocate":
        comm.open_shared_memory()
        assert comm.shm.active, comm.transport
    if dist.get_rank() == victim:
        _arm(point, die)
    return {**_timed_set_up(step, comm), "pids": pids, "left": segment_files(pids)}


KILLS = [("open", "_attach", 1), ("open", "_attach", 0), ("allocate", "_attach", 1), ("allocate", "_agree", 0)]


@pytest.mark.parametrize("step,point,victim", KILLS)
def test_a_killed_rank_leaves_no_file(step: str, point: str, victim: int) -> None:
    """The survivor removes the file(s) of the killed rank too: a process killed with SIGKILL cleans nothing."""
    results = run_distributed(_killed_at, 2, args=(step, point, victim), timeout=90, expect_dead=(victim,))
    survivor = results[1 - victim]
    assert results[victim] is None, "the victim was meant to die"
    assert survivor["error"] == "RankGoneError", survivor
    assert survivor["left"] == [], survivor
    assert segment_files(survivor["pids"]) == [], survivor
    record_row("death", f"rank {victim} killed while mapping (set-up step: {step} a "
               f"{'segment' if step == 'open' else 'shared buffer'}, at `{point.strip('_')}`)", "0-3",
               "the other rank raises `RankGoneError` and removes every file of the set-up, its peer's too",
               survivor["seconds"])


def _killed_after_create() -> dict[str, Any]:
    pids: list[Any] = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if dist.get_rank() == 0:
        original = shm._create

        def create(size: int) -> Any:
            original(size)
            die()  # before rank 1 can learn the name

        shm._create = create
    comm = Comm(None, timeout=TIMEOUT * 10)
    try:
        comm.open_shared_memory()
    except Exception:  # noqa: BLE001 - the survivor's error is another test's subject
        pass
    return {"pids": pids}


def test_a_creator_killed_before_it_shared_the_name_is_swept_by_the_next_set_up() -> None:
    """Nobody else knows that file: the next set-up on the host removes files of processes that no longer exist."""
    results = run_distributed(_killed_after_create, 2, timeout=90, expect_dead=(0,))
    pids = results[1]["pids"]
    # the one file nobody else could know (0 where another job's set-up on this host swept it first, as the
    # next set-up must: seen when the fault table ran beside other test runs)
    assert len(segment_files(pids)) <= 1, segment_files(pids)
    segment, reason = shm.open_segment(0, 1, [0], TIMEOUT, lambda offer: offer, lambda ok: ok)  # the next set-up
    assert segment is not None, reason
    segment.close()
    assert segment_files([*pids, os.getpid()]) == []
    record_row("death", "rank 0 killed between creating the segment file and sharing its name", "0-3",
               "its file is removed by the next shared-memory set-up on the host (a restart's), which removes "
               "this user's segment files whose creating process is gone (rank 1's error: another row)", None)
