"""shardwise.comm.exit: the collectives nobody waited for are waited for at exit, bounded, and never raise."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from shardwise.comm import exit as shardwise_exit


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
    saved = dict(shardwise_exit._UNWAITED)
    shardwise_exit._UNWAITED.clear()
    yield
    shardwise_exit._UNWAITED.clear()
    shardwise_exit._UNWAITED.update(saved)


def test_waited_collectives_are_forgotten_and_the_memory_is_bounded() -> None:
    waited, abandoned = _FakeWork(False), _FakeWork(False)
    shardwise_exit.track(waited)
    shardwise_exit.track(abandoned)
    shardwise_exit.forget(waited)
    assert list(shardwise_exit._UNWAITED.values()) == [abandoned]
    many = [_FakeWork(False) for _ in range(shardwise_exit._MAX_TRACKED + 10)]
    for work in many:
        shardwise_exit.track(work)
    assert len(shardwise_exit._UNWAITED) == shardwise_exit._MAX_TRACKED
    assert abandoned not in shardwise_exit._UNWAITED.values(), "the oldest go first"


def test_exit_waits_for_unwaited_collectives_with_a_bound_and_swallows_failures() -> None:
    running, dead_peer = _FakeWork(False), _FakeWork(False, fails=True)
    for work in (running, dead_peer):
        shardwise_exit.track(work)
    shardwise_exit._settle()  # must not raise: the process is exiting
    assert running.waited == [timedelta(seconds=shardwise_exit._WAIT_S)]
    assert dead_peer.waited == [timedelta(seconds=shardwise_exit._WAIT_S)]
    assert shardwise_exit._UNWAITED == {}


def _collectives_are_tracked_until_waited() -> list[bool]:
    import torch

    from shardwise.comm.distributed import Comm

    comm = Comm(timeout=30)
    full, grads = torch.zeros(8), torch.ones(8)
    gather = comm.all_gather(full, torch.full((4,), float(comm.rank)), async_op=True)
    reduce = comm.reduce_scatter(torch.zeros(4), grads, async_op=True)
    tracked = len(shardwise_exit._UNWAITED) == 2
    gather.wait()
    reduce.wait()  # gloo's reduce-scatter says is_completed() False even now: forgetting must not rely on it
    return [tracked, shardwise_exit._UNWAITED == {}, full.tolist() == [0.0] * 4 + [1.0] * 4]


def test_comm_tracks_its_asynchronous_collectives_until_they_are_waited() -> None:
    from shardwise.testing import run_distributed

    assert run_distributed(_collectives_are_tracked_until_waited, world_size=2) == [[True, True, True]] * 2
