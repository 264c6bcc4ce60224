"""shardwise.exit: the collectives nobody waited for are waited for at exit, bounded, and never raise."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from shardwise import exit as shardwise_exit


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
    saved = list(shardwise_exit._UNWAITED)
    shardwise_exit._UNWAITED.clear()
    yield
    shardwise_exit._UNWAITED[:] = saved


def test_finished_collectives_are_forgotten_when_the_next_is_tracked() -> None:
    done, running = _FakeWork(True), _FakeWork(False)
    shardwise_exit.track(done)
    shardwise_exit.track(running)
    shardwise_exit.track(_FakeWork(False))
    assert done not in shardwise_exit._UNWAITED and running in shardwise_exit._UNWAITED


def test_exit_waits_for_unwaited_collectives_with_a_bound_and_swallows_failures() -> None:
    running, dead_peer, done = _FakeWork(False), _FakeWork(False, fails=True), _FakeWork(True)
    for work in (running, dead_peer, done):
        shardwise_exit._UNWAITED.append(work)
    shardwise_exit._settle()  # must not raise: the process is exiting
    assert running.waited == [timedelta(seconds=shardwise_exit._WAIT_S)]
    assert dead_peer.waited == [timedelta(seconds=shardwise_exit._WAIT_S)]
    assert done.waited == []
    assert shardwise_exit._UNWAITED == []


def _async_gather_is_tracked() -> list[bool]:
    import torch

    from shardwise.distributed import Comm

    comm = Comm(timeout=30)
    full = torch.zeros(8)
    handle = comm.all_gather(full, torch.full((4,), float(comm.rank)), async_op=True)
    tracked = len(shardwise_exit._UNWAITED) >= 1
    handle.wait()
    shardwise_exit._settle()
    return [tracked, shardwise_exit._UNWAITED == [], full.tolist() == [0.0] * 4 + [1.0] * 4]


def test_comm_tracks_its_asynchronous_collectives_for_exit() -> None:
    from shardwise.testing import run_distributed

    assert run_distributed(_async_gather_is_tracked, world_size=2) == [[True, True, True]] * 2
