"""A rank dies (SIGKILL) in forward, backward, step, save or load, at every stage: the survivor names it, fast.

Two ranks; rank 1 kills itself at a chosen point of its fourth step (a forward
pre-hook, a gradient hook, the inner optimizer's step) or inside DCP's write or
read of a checkpoint.  Rank 0 must raise `RankGoneError` naming rank 1 and the
operation it was in, within `comms.timeout` (3 s here; 300 s by default),
instead of waiting for the process-group timeout (30 minutes); after a death
during a save, `latest` still names the previous checkpoint, which is complete.
Each case is a launch of its own: after a death the process group cannot be
used again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from _faults_common import COMMS_TIMEOUT, VICTIM, die, make_engine, outcome, record_row, train_step

from shardwise.checkpoint.layout import read_latest
from shardwise.checkpoint.save import _RankWriter
from shardwise.checkpoint.storage import SafeReader
from shardwise.checkpoint.validate import check_complete
from shardwise.testing import run_distributed

STAGES = (0, 1, 2, 3)
PHASES = ("forward", "backward", "step", "save", "load")


def _arm(engine: Any, phase: str) -> None:
    """Make this rank die at ``phase`` of its next step, save or load."""
    if phase == "forward":
        engine.module.fc2.register_forward_pre_hook(lambda module, args: die())
    elif phase == "backward":
        # fc1's gradient comes after head's and fc2's: the survivor is mid-reduction by then
        engine.module.fc1.weight.register_hook(lambda grad: die())
    elif phase == "step":
        engine.optimizer.inner.step = lambda *args, **kwargs: die()
    elif phase == "save":
        _RankWriter.write_data = lambda *args, **kwargs: die()  # inside DCP's write
    else:
        SafeReader.read_data = lambda *args, **kwargs: die()  # inside DCP's read


def _die_in(phase: str, stage: int, root: str) -> dict[str, Any]:
    engine = make_engine(stage)
    for step in range(3):
        train_step(engine, step)
    engine.save_checkpoint(root, tag="before")
    if dist.get_rank() == VICTIM:
        _arm(engine, phase)
    if phase == "save":
        result = outcome(lambda: engine.save_checkpoint(root, tag="during"))
    elif phase == "load":
        result = outcome(lambda: engine.load_checkpoint(root, tag="before"))
    else:
        result = outcome(lambda: [train_step(engine, step) for step in range(3, 6)])
    result["latest"] = read_latest(Path(root))
    check_complete(Path(root) / result["latest"])  # the previous checkpoint is whole (local: no collective)
    return result


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("phase", PHASES)
def test_survivor_names_the_dead_rank(phase: str, stage: int, tmp_path: Path) -> None:
    survivor, victim = run_distributed(_die_in, 2, args=(phase, stage, str(tmp_path / "ckpt")), timeout=90,
                                       expect_dead=(VICTIM,))
    assert victim is None, "rank 1 was meant to die"
    assert survivor["error"] == "RankGoneError", survivor
    assert survivor["gone"] == [VICTIM], survivor
    message = survivor["message"]
    assert "rank(s) [1] are gone" in message and "--max-restarts" in message, message
    if phase in ("save", "load"):
        # the checkpoint's store steps name the step and the operation
        assert "while this rank waited for them to finish" in message and "_checkpoint`" in message, message
    else:
        assert "rank 1: gone: its heartbeat stopped" in message, message
        # this rank's own operation is named: the engine call and the collective it waited on (or, when the
        # peer died before the survivor's next operation began, that operation, whose announcement failed)
        assert ("rank 0: waiting on #" in message or "rank 0: in `" in message) and "of engine (stage" in message, \
            message
    assert survivor["latest"] == "before", survivor
    assert survivor["seconds"] < COMMS_TIMEOUT, survivor
    where = {"save": "in DCP's write of `save_checkpoint`", "load": "in DCP's read of `load_checkpoint`"}
    after = "; `latest` and the previous checkpoint untouched" if phase == "save" else ""
    record_row("death", f"rank 1 killed {where.get(phase, f'in `{phase}`')}", str(stage),
               f"rank 0 raises `RankGoneError` naming rank 1 and its own operation{after}", survivor["seconds"])
