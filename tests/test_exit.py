"""shardwise.comm.distributed: the collectives nobody waited for are waited for at exit, bounded, and never raise."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from shardwise.comm import distributed as comm_distributed


class _FakeWork:
    def __init__(self, completed: bool, fails: bool = False) -> None:
        self.completed = completed
        self.fails = fails
        self.waited: list[Any] = []

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, timeout: Any = None) -> bool:
        self.waited.append(timeout)
        if self.fails:
            raise RuntimeError("Connection closed by peer")
        self.completed = True
        return True


@pytest.fixture(autouse=True)
def _empty() -> Any:
    saved = dict(comm_distributed._UNWAITED)
    comm_distributed._UNWAITED.clear()
    yield
    comm_distributed._UNWAITED.clear()
    comm_distributed._UNWAITED.update(saved)


def test_waited_collectives_are_forgotten_and_the_memory_is_bounded() -> None:
    waited, abandoned = _FakeWork(False), _FakeWork(False)
    comm_distributed._track(waited)
    comm_distributed._track(abandoned)
    comm_distributed._UNWAITED.pop(id(waited), None)
    assert list(comm_distributed._UNWAITED.values()) == [abandoned]
    many = [_FakeWork(False) for _ in range(comm_distributed._MAX_TRACKED + 10)]
    for work in many:
        comm_distributed._track(work)
    assert len(comm_distributed._UNWAITED) == comm_distributed._MAX_TRACKED
    assert abandoned not in comm_distributed._UNWAITED.values(), "the oldest go first"


def test_exit_waits_for_unwaited_collectives_with_a_bound_and_swallows_failures() -> None:
    running, dead_peer = _FakeWork(False), _FakeWork(False, fails=True)
    for work in (running, dead_peer):
        comm_distributed._track(work)
    comm_distributed._settle()  # must not raise: the process is exiting
    assert running.waited == [timedelta(seconds=comm_distributed._WAIT_S)]
    assert dead_peer.waited == [timedelta(seconds=comm_distributed._WAIT_S)]
    assert comm_distributed._UNWAITED == {}


def _collectives_are_tracked_until_waited() -> list[bool]:
    import torch

    from shardwise.comm.distributed import Comm

    comm = Comm(timeout=30)
    full, grads = torch.zeros(8), torch.ones(8)
    gather = comm.all_gather(full, torch.full((4,), float(comm.rank)), async_op=True)
    reduce = comm.reduce_scatter(torch.zeros(4), grads, async_op=True)
    tracked = len(comm_distributed._UNWAITED) == 2
    gather.wait()
    reduce.wait()  # gloo's reduce-scatter says is_completed() False even now: forgetting must not rely on it
    return [tracked, comm_distributed._UNWAITED == {}, full.tolist() == [0.0] * 4 + [1.0] * 4]


def test_comm_tracks_its_asynchronous_collectives_until_they_are_waited() -> None:
    from shardwise.testing import run_distributed

    assert run_distributed(_collectives_are_tracked_until_waited, world_size=2) == [[True, True, True]] * 2
