"""Ranks that disagree, or one that stops answering: every rank raises, naming where each rank was.

* a rank that hangs (alive, stuck in its forward) makes the others raise a
  `CommError` within `comms.timeout` saying it is alive and busy, through shared
  memory and over gloo's sockets (`comms.shared_memory: false`);
* at ZeRO-3, ranks running different modules of the same size pair their
  gathers silently: the step check raises `CollectiveMismatchError` on every
  rank before the optimizer applies anything (the weights stay as they were);
* with `comms.debug`, ranks running modules of different sizes are stopped
  before the first differing gather, on every rank;
* a rank that raises on its own (a non-scalar loss) is named by the others,
  with its error;
* one rank calling `step()` while the other runs `backward()`.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _faults_common import COMMS_TIMEOUT, VICTIM, fault_config, make_engine, outcome, record_row, train_step
from _parity import adamw, batch
from torch import nn

import shardwise
from shardwise.testing import run_distributed


class TwoBranches(nn.Module):
    """A trunk and two branches; ``forward(x, branch)`` runs one of them (chosen per rank in these tests)."""

    def __init__(self, wide_b: bool = False) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 8)) if wide_b else nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, branch: str) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        h = torch.tanh(self.a(h) if branch == "a" else self.b(h))
        return self.head(h)


def _branch_engine(debug: bool, wide_b: bool, shared: bool = True) -> Any:
    torch.manual_seed(0)
    model = TwoBranches(wide_b)
    # No prefetch: each rank gathers exactly the modules it runs, so same-size gathers pair up silently
    # (with prefetch, a mispredicted unit adds a collective on one rank and the sizes soon differ).
    config = fault_config(3, comms={"debug": debug, "shared_memory": shared},
                          zero_optimization={"stage3_prefetch_bucket_size": 0})
    return shardwise.initialize(model, adamw(model.parameters()), config)


def _branch_step(engine: Any, branch: str) -> None:
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
    engine.backward(F.mse_loss(engine(x, branch), y))
    engine.step()


def _different_modules(debug: bool, wide_b: bool, shared: bool = True) -> dict[str, Any]:
    engine = _branch_engine(debug, wide_b, shared)
    _branch_step(engine, "a")  # both ranks agree once
    before = _local_masters(engine)
    mine = "a" if dist.get_rank() == 0 else "b"
    result = outcome(lambda: _branch_step(engine, mine))
    result["unchanged"] = all(torch.equal(x, y) for x, y in zip(before, _local_masters(engine)))
    return result


def _local_masters(engine: Any) -> list[torch.Tensor]:
    """This rank's fp32 master pieces (what the optimizer updates)."""
    return [group_param.detach().clone() for group in engine.optimizer.inner.param_groups
            for group_param in group["params"]]


def test_zero3_same_size_modules_are_caught_by_the_step_check() -> None:
    """Gathers of `a` on rank 0 and `b` on rank 1 pair silently; the step check stops the update on both ranks."""
    results = run_distributed(_different_modules, 2, args=(False, False), timeout=90)
    for rank, result in enumerate(results):
        assert result["error"] == "CollectiveMismatchError", result
        message = result["message"]
        assert "The first collective that differs is number" in message, message
        assert "`a.weight` and 1 more" in message and "`b.weight` and 1 more" in message, message
        assert "in the step check at `step` of engine (stage 3, TwoBranches)" in message, message
        assert result["unchanged"], f"rank {rank}: the optimizer applied gradients of mismatched collectives"
    record_row("disagree", "ranks run different modules of one size (rank 0 `a`, rank 1 `b`)", "3",
               "every rank raises `CollectiveMismatchError` at `step()`, before the update, naming the first "
               "differing gather (`a.weight` vs `b.weight`)", max(r["seconds"] for r in results))


def test_zero3_different_size_modules_with_debug_stop_before_data_moves() -> None:
    results = run_distributed(_different_modules, 2, args=(True, True), timeout=90)
    for result in results:
        assert result["error"] == "CollectiveMismatchError", result
        message = result["message"]
        assert "collective check (`comms.debug`) before" in message, message
        assert "`a.weight`" in message and "`b.0.weight`" in message, message
    record_row("disagree", "ranks run different modules of different sizes, `comms.debug: true`", "3",
               "every rank raises `CollectiveMismatchError` before the first differing gather, naming both modules",
               max(r["seconds"] for r in results))


#: a shorter timeout for the hang tests, which wait it out
HANG_TIMEOUT = 1.5


def test_zero3_different_size_modules_without_debug() -> None:
    """Through shared memory (the default on one host) the ranks' collectives stop pairing up: after
    `comms.timeout` every rank raises before the optimizer applies anything, saying where each rank was."""
    results = run_distributed(_different_modules, 2, args=(False, True), timeout=90)
    errors = sorted(r["error"] for r in results)
    # the rank that reached the step check sees the mismatch; the other, still in a collective, names it
    assert "CollectiveMismatchError" in errors and set(errors) <= {"CollectiveMismatchError", "CommError"}, results
    for rank, result in enumerate(results):
        assert "Where each rank of process group" in result["message"], result["message"]
        assert result["unchanged"], f"rank {rank}: the optimizer applied gradients of mismatched collectives"
    record_row("disagree", "ranks run different modules of different sizes (default `comms`)", "3",
               "after `comms.timeout` every rank raises before the update: `CollectiveMismatchError` where the step "
               "check saw it, `CommError` naming that rank on the other (`comms.debug: true` stops both before "
               "data moves)", max(r["seconds"] for r in results))


def test_zero3_different_size_modules_over_gloo_sockets() -> None:
    """gloo aborts the rank that receives a larger message than it posted; the other names it gone."""
    results = run_distributed(_different_modules, 2, args=(False, True, False), timeout=90, expect_dead=(0, 1))
    alive = [r for r in results if r is not None]
    assert len(alive) == 1, results
    dead = results.index(None)
    assert alive[0]["error"] == "RankGoneError" and alive[0]["gone"] == [dead], alive
    record_row("disagree", "ranks run different modules of different sizes (`comms.shared_memory: false`)", "3",
               "gloo aborts the rank receiving the larger message; the other raises `RankGoneError` naming it",
               alive[0]["seconds"])


def _hang_in_forward(stage: int, shared: bool = True) -> dict[str, Any]:
    engine = make_engine(stage, comms={"timeout": HANG_TIMEOUT, "shared_memory": shared})
    train_step(engine, 0)
    if dist.get_rank() == VICTIM:
        # Stuck longer than the timeout allows: a survivor that waited the peer out would finish its
        # step without error (after HANG_TIMEOUT + 1 s), and fail the checks.
        engine.module.fc2.register_forward_pre_hook(lambda module, args: time.sleep(HANG_TIMEOUT + 1.0))
    return outcome(lambda: train_step(engine, 1))


@pytest.mark.parametrize("stage", [0, 3])
def test_a_hung_rank_is_named_alive_and_busy(stage: int) -> None:
    survivor, stuck = run_distributed(_hang_in_forward, 2, args=(stage,), timeout=90)
    assert survivor["error"] == "CommError", survivor
    message = survivor["message"]
    assert f"within `comms.timeout` = {HANG_TIMEOUT:g} s" in message, message
    assert "rank 1: busy in `forward` of engine" in message, message
    assert HANG_TIMEOUT <= survivor["seconds"] < 2 * HANG_TIMEOUT, survivor
    assert stuck["error"] is not None, "rank 1 cannot finish its step once rank 0 gave up"
    record_row("disagree", "rank 1 hangs in `forward` (alive, stuck)", str(stage),
               "rank 0 raises `CommError` at `comms.timeout`: rank 1 is alive and busy in `forward`",
               survivor["seconds"])


@pytest.mark.parametrize("stage", [0, 3])
def test_a_hung_rank_is_named_over_gloo_sockets(stage: int) -> None:
    """`comms.shared_memory: false`: gloo's own collectives carry `comms.timeout`, so the survivor gives up
    at the timeout instead of waiting out the stuck peer (gloo's default wait is 30 minutes)."""
    survivor, stuck = run_distributed(_hang_in_forward, 2, args=(stage, False), timeout=90)
    assert survivor["error"] == "CommError", f"rank 0 waited out the stuck rank 1 instead of raising: {survivor}"
    message = survivor["message"]
    assert f"within `comms.timeout` = {HANG_TIMEOUT:g} s" in message, message
    assert "rank 1: busy in `forward` of engine" in message, message
    assert HANG_TIMEOUT <= survivor["seconds"] < 2 * HANG_TIMEOUT, survivor
    assert stuck["error"] is not None, "rank 1 cannot finish its step once rank 0 gave up"
    record_row("disagree", "rank 1 hangs in `forward` (alive, stuck; `comms.shared_memory: false`)", str(stage),
               "rank 0 raises `CommError` at `comms.timeout` (gloo's own timeout): rank 1 is alive and busy in "
               "`forward`", survivor["seconds"])


def _raise_on_one_rank(stage: int) -> dict[str, Any]:
    engine = make_engine(stage)
    train_step(engine, 0)

    def step() -> None:
        loss = engine(*batch(1, dist.get_rank()))
        engine.backward(loss if dist.get_rank() != VICTIM else loss.expand(3))
        engine.step()

    return outcome(step)


def test_a_rank_that_raises_is_named_with_its_error() -> None:
    survivor, raiser = run_distributed(_raise_on_one_rank, 2, args=(2,), timeout=90)
    assert raiser["error"] == "ValueError" and "needs a scalar loss, got shape (3,)" in raiser["message"], raiser
    assert survivor["error"] == "PeerFailedError" and survivor["failed"] == [VICTIM], survivor
    assert "needs a scalar loss" in survivor["message"], survivor
    record_row("disagree", "rank 1 raises in `backward` (a non-scalar loss)", "2",
               "rank 1 raises `ValueError`; rank 0 raises `PeerFailedError` quoting it", survivor["seconds"])


def _step_while_other_backwards(stage: int) -> dict[str, Any]:
    engine = make_engine(stage, gradient_accumulation_steps=2)
    for step in range(2):
        train_step(engine, step)

    def diverge() -> None:
        # rank 0 follows the loop; rank 1 skips the step of the first micro-batch, so its second backward
        # is no boundary: it runs `backward` where rank 0 runs `step`, and the ranks fall out of phase
        for step in range(2, 8):
            loss = engine(*batch(step, dist.get_rank()))
            engine.backward(loss)
            if dist.get_rank() != VICTIM or step != 2:
                engine.step()

    return outcome(diverge)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_on_one_rank_backward_on_the_other(stage: int) -> None:
    results = run_distributed(_step_while_other_backwards, 2, args=(stage,), timeout=90)
    for result in results:
        assert result["error"] == "CollectiveMismatchError", result
        assert result["seconds"] < 3 * COMMS_TIMEOUT, result
    at_check = all("in the step check" in r["message"] and "backwards accumulated: rank 0 2, rank 1 3" in r["message"]
                   for r in results)
    how = ("at the step check, before the update: backwards accumulated differ (rank 0 2, rank 1 3)" if at_check
           else "when the differing collectives (a gather against a reduce-scatter) time out, naming both")
    record_row("disagree", "rank 1 runs 3 micro-batches into a step where rank 0 runs 2 (it skips one `step()`: "
               "`backward` on one rank while the other runs `step`)", str(stage),
               f"every rank raises `CollectiveMismatchError` {how}", max(r["seconds"] for r in results))
