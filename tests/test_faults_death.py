"""A rank dies (SIGKILL) in forward, backward or step, at every stage: the survivor names it, fast.

Two ranks; rank 1 kills itself at a chosen point of its fourth step (a forward
pre-hook, a gradient hook, the inner optimizer's step).  Rank 0 must raise
`RankGoneError` naming rank 1 and the operation it was in, within
`comms.timeout` (3 s here; 300 s by default), instead of waiting for the
process-group timeout (30 minutes).  Each case is a launch of its own: after a
death the process group cannot be used again.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from shardwise.testing import run_distributed

from _faults_common import COMMS_TIMEOUT, VICTIM, die, first_line, make_engine, outcome, record_row, train_step

STAGES = (0, 1, 2, 3)
PHASES = ("forward", "backward", "step")


def _arm(engine: Any, phase: str) -> None:
    """Make this rank die at ``phase`` of its next step."""
    if phase == "forward":
        engine.module.fc2.register_forward_pre_hook(lambda module, args: die())
    elif phase == "backward":
        # fc1's gradient comes after head's and fc2's: the survivor is mid-reduction by then
        engine.module.fc1.weight.register_hook(lambda grad: die())
    else:
        engine.optimizer.inner.step = lambda *args, **kwargs: die()


def _die_in(phase: str, stage: int) -> dict[str, Any]:
    engine = make_engine(stage)
    for step in range(3):
        train_step(engine, step)
    if dist.get_rank() == VICTIM:
        _arm(engine, phase)
    return outcome(lambda: [train_step(engine, step) for step in range(3, 6)])


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("phase", PHASES)
def test_survivor_names_the_dead_rank(phase: str, stage: int) -> None:
    survivor, victim = run_distributed(_die_in, 2, args=(phase, stage), timeout=90, expect_dead=(VICTIM,))
    assert victim is None, "rank 1 was meant to die"
    assert survivor["error"] == "RankGoneError", survivor
    assert survivor["gone"] == [VICTIM], survivor
    message = survivor["message"]
    assert "rank(s) [1] are gone" in message and "--max-restarts" in message, message
    assert "rank 1: gone: its heartbeat stopped" in message, message
    # this rank's own operation is named: the engine call and the collective it waited on
    assert "rank 0: waiting on #" in message and "of engine (stage" in message, message
    assert survivor["seconds"] < COMMS_TIMEOUT, survivor
    record_row("death", f"rank 1 killed in `{phase}`", str(stage),
               f"rank 0 raises `RankGoneError`: {first_line(message).split(';')[0]}", survivor["seconds"])
