"""Tests of the multi-rank harness `shardwise.testing`.

Every rank body is a module-level function: ranks import this module by name to find it.
Failure tests use small timeouts and assert on elapsed time, so a harness that waits for
the full timeout (or hangs) fails here instead of slowing the whole suite.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import DistributedTestError, distributed_test, run_distributed, run_subtests

# Generous bound for "fails fast": a launch costs ~0.1 s with the forkserver warm.
FAST_S = 10.0

_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# --------------------------------------------------------------------------- rank bodies


def _describe_rank(tag: str) -> dict[str, Any]:
    """Report what the rank sees: its place in the world, env vars, threads, a collective."""
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return {
        "tag": tag,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "sum_of_ranks": total.item(),
        "threads": torch.get_num_threads(),
        "env": {key: os.environ.get(key) for key in _ENV_KEYS},
        "user_env": os.environ.get("SHARDWISE_HARNESS_TEST"),
        "parent_env": os.environ.get("SHARDWISE_HARNESS_PARENT"),
    }


def _raise_on_rank_1() -> None:
    """Rank 1 raises; rank 0 blocks in a collective rank 1 never joins."""
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    dist.all_reduce(torch.ones(1))


def _sleep_on_rank_1() -> str:
    """Rank 1 never finishes; rank 0 returns at once."""
    if dist.get_rank() == 1:
        time.sleep(60)
    return "done"


def _mismatched_collectives() -> None:
    """Rank 0 waits in all_reduce while rank 1 waits for a message rank 0 never sends."""
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    else:
        dist.recv(torch.empty(1), src=0)


def _exit_hard_on_rank_1(how: str) -> None:
    """Rank 1 leaves without a traceback (os._exit or SIGKILL); rank 0 blocks in a collective."""
    if dist.get_rank() == 1:
        print("last words of rank 1", file=sys.stderr, flush=True)
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def _return_unpicklable() -> Any:
    """Return something pickle cannot send back."""
    return lambda: None


def _print_and_destroy() -> int:
    """Print, then tear the process group down itself (the harness must not do it twice)."""
    print(f"hello from rank {dist.get_rank()}")
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank


def _check_case(x: int, failing: tuple[int, ...]) -> None:
    """A sub-case that runs a collective, then fails when `x` is in `failing`."""
    dist.all_reduce(torch.ones(1))
    if x in failing:
        raise RuntimeError(f"case x={x} broke")


def _subtests_in_rank() -> None:
    """Cases 1 and 3 fail on rank 1 only; every case still runs, in step, on both ranks."""
    failing = (1, 3) if dist.get_rank() == 1 else ()
    run_subtests(_check_case, [{"x": x, "failing": failing} for x in range(4)])


# --------------------------------------------------------------------------- happy path


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_results_come_back_in_rank_order(world_size: int) -> None:
    results = run_distributed(_describe_rank, world_size, args=("t",), timeout=60)
    assert [r["rank"] for r in results] == list(range(world_size))
    ports = {r["env"]["MASTER_PORT"] for r in results}
    assert len(ports) == 1 and ports.pop().isdigit()
    for rank, info in enumerate(results):
        assert info["world_size"] == world_size
        assert info["backend"] == "gloo"
        assert info["sum_of_ranks"] == sum(range(world_size))
        assert info["threads"] == 1
        env = info["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(world_size)
        assert env["MASTER_ADDR"] == "127.0.0.1"


def test_env_kwargs_and_threads_reach_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_HARNESS_PARENT", "from-parent")
    results = run_distributed(_describe_rank, 2, kwargs={"tag": "kw"}, timeout=60,
                              env={"SHARDWISE_HARNESS_TEST": "from-env"}, threads_per_rank=2)
    for info in results:
        assert info["tag"] == "kw"
        assert info["user_env"] == "from-env"
        assert info["parent_env"] == "from-parent"
        assert info["threads"] == 2


def test_rank_output_is_replayed_and_own_destroy_is_fine(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert run_distributed(_print_and_destroy, 2, timeout=60) == [0, 1]
    out = capsys.readouterr().out
    assert "[rank 0] hello from rank 0" in out
    assert "[rank 1] hello from rank 1" in out


def test_launch_directory_is_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run_distributed(_describe_rank, 2, args=("t",), timeout=60)
    with pytest.raises(DistributedTestError):
        run_distributed(_raise_on_rank_1, 2, timeout=60)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- failures


def test_rank_that_raises_is_reported_with_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank_1, 2, timeout=60)
    assert time.monotonic() - start < FAST_S
    message = str(info.value)
    assert "rank 1" in message
    assert "Traceback (most recent call last)" in message
    assert "_raise_on_rank_1" in message
    assert "ValueError: boom from rank 1" in message


def test_sleeping_rank_times_out_with_its_stack() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_sleep_on_rank_1, 2, timeout=1.5)
    elapsed = time.monotonic() - start
    assert 1.5 <= elapsed < 1.5 + FAST_S
    message = str(info.value)
    assert "ranks [1] of 2 did not finish within the 1.5 s timeout" in message
    assert "finished: [0]" in message
    assert "_sleep_on_rank_1" in message  # the stack dumped at the timeout


def test_ranks_stuck_in_mismatched_collectives_time_out() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_mismatched_collectives, 2, timeout=1.5)
    assert time.monotonic() - start < 1.5 + FAST_S
    message = str(info.value)
    assert "ranks [0, 1] of 2 did not finish within the 1.5 s timeout" in message
    assert "all_reduce" in message and "recv" in message


@pytest.mark.parametrize(("how", "expected"), [
    ("exit", "rank 1 exited with code 3 before returning a result"),
    ("kill", "rank 1 was killed by SIGKILL (exit code -9)"),
])
def test_rank_that_dies_hard_is_reported_quickly(how: str, expected: str) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_exit_hard_on_rank_1, 2, args=(how,), timeout=60)
    assert time.monotonic() - start < FAST_S  # not the 60 s timeout
    message = str(info.value)
    assert expected in message
    assert "last words of rank 1" in message  # the tail of its stderr
    # Rank 0 is either killed in its collective or, when gloo notices the lost peer
    # first, reported as raising after rank 1; either way rank 1 is named first.
    assert message.startswith("rank 1 of 2 failed.")
    assert "ranks [0] were killed after rank 1 failed" in message or "rank 0 raised" in message


def test_unpicklable_return_value_names_the_rank() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_return_unpicklable, 1, timeout=60)
    assert "rank 0 raised" in str(info.value)
    assert "pickle" in str(info.value).lower()


def test_unpicklable_function_fails_before_launch() -> None:
    with pytest.raises(TypeError, match="module level"):
        run_distributed(lambda: None, 2)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"world_size": 0}, "world_size"),
    ({"timeout": 0}, "timeout"),
    ({"threads_per_rank": 0}, "threads_per_rank"),
    ({"start_method": "teleport"}, "start method"),
])
def test_bad_arguments_are_rejected(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_distributed(_describe_rank, **kwargs)


# --------------------------------------------------------------------------- distributed_test


@distributed_test(world_size=2, timeout=60)
def test_decorated_body_runs_on_every_rank() -> None:
    assert dist.get_world_size() == 2
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == 2.0


@distributed_test
def test_bare_decorator_uses_two_ranks() -> None:
    assert dist.get_world_size() == 2


@pytest.mark.parametrize("world_size", [3])
@distributed_test(world_size=3, timeout=60)
def test_decorated_body_gets_fixtures_and_parameters(world_size: int, tmp_path: Path) -> None:
    assert dist.get_world_size() == world_size
    (tmp_path / f"rank{dist.get_rank()}").write_text("ok")
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1", "rank2"]


class TestDecoratedMethods:
    @distributed_test(world_size=2, timeout=60)
    def test_method_body_runs_on_every_rank(self) -> None:
        assert isinstance(self, TestDecoratedMethods)
        assert dist.get_world_size() == 2


@distributed_test(world_size=2, timeout=60)
def _decorated_failure() -> None:
    """Not collected (no test_ prefix): called by a test that expects it to fail."""
    if dist.get_rank() == 0:
        raise AssertionError("rank 0 disagrees")


def test_decorated_failure_raises_distributed_test_error() -> None:
    with pytest.raises(DistributedTestError, match="rank 0 disagrees"):
        _decorated_failure()


def test_decorator_rejects_nested_functions() -> None:
    def body() -> None:
        pass

    with pytest.raises(TypeError, match="module or class level"):
        distributed_test()(body)


# --------------------------------------------------------------------------- run_subtests


def test_subtests_report_every_failing_case_on_their_rank() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_subtests_in_rank, 2, timeout=60)
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed.")
    assert "2 of 4 subtests of `_check_case` failed on rank 1" in message
    for x in (1, 3):
        assert f"case {{'x': {x}, 'failing': (1, 3)}}" in message
        assert f"RuntimeError: case x={x} broke" in message
    assert "x=0 broke" not in message and "x=2 broke" not in message
    assert "rank 0 raised" not in message  # rank 0 passed every case and returned


def _flaky_case(value: int) -> None:
    """Fails for odd values."""
    if value % 2:
        raise ValueError(f"odd value {value}")


def test_subtests_without_process_group_collect_all_failures() -> None:
    with pytest.raises(AssertionError) as info:
        run_subtests(_flaky_case, [{"value": v} for v in range(5)])
    message = str(info.value)
    assert message.startswith("2 of 5 subtests of `_flaky_case` failed:")
    assert "case {'value': 1}" in message and "ValueError: odd value 1" in message
    assert "case {'value': 3}" in message and "ValueError: odd value 3" in message
    assert "case {'value': 2}" not in message
    run_subtests(_flaky_case, [{"value": 0}, {"value": 2}])  # all pass: no error


def test_spawn_start_method_works_too() -> None:
    """The fallback when a forkserver is unavailable: slower (a fresh interpreter per rank)."""
    [info] = run_distributed(_describe_rank, 1, args=("spawned",), timeout=120,
                             start_method="spawn")
    assert info["tag"] == "spawned" and info["env"]["RANK"] == "0" and info["threads"] == 1
