"""Pipeline schedules as data: per stage, a list of actions (forward or backward, micro-batch).

The engine executes such a list with a small loop, as ``torch.distributed.pipelining`` does; nothing about the order is
hidden in control flow (1F1B's order and memory bound: docs/pipeline.md, "The schedule").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Action", "Phase", "forward_only", "one_f_one_b"]


class Phase(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True)
class Action:
    """Run ``phase`` of micro-batch ``micro_batch`` on this stage."""

    phase: Phase
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.phase.value}{self.micro_batch}"


def one_f_one_b(stage: int, num_stages: int, micro_batches: int) -> list[Action]:
    """The 1F1B training schedule of ``stage``."""
    warmup = min(num_stages - stage - 1, micro_batches)
    actions = [Action(Phase.FORWARD, m) for m in range(warmup)]
    forwards = warmup
    for backward in range(micro_batches):
        if forwards < micro_batches:
            actions.append(Action(Phase.FORWARD, forwards))
            forwards += 1
        actions.append(Action(Phase.BACKWARD, backward))
    return actions


def forward_only(micro_batches: int) -> list[Action]:
    """Evaluation: every micro-batch forward, nothing else."""
    return [Action(Phase.FORWARD, m) for m in range(micro_batches)]
