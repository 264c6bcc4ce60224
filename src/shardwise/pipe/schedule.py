"""Pipeline schedules as data: per stage, a list of actions (forward or backward, micro-batch).

The engine executes such a list with a small loop (receive what the action
needs, compute, send what it produced), as ``torch.distributed.pipelining``
does; nothing about the order is hidden in control flow.

1F1B (one forward, one backward): stage ``s`` of ``S`` first runs ``S - s - 1``
forwards (the warm-up that fills the pipe), then alternates one forward and
one backward, then drains the remaining backwards.  A stage holds at most
``S - s`` micro-batches' activations at once, whatever the number of
micro-batches ``M``; with equal stage times the idle share of each stage is
``(S - 1) / (M + S - 1)``, which :func:`simulate` reproduces.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Action", "Phase", "bubble_fraction", "forward_only", "one_f_one_b", "simulate"]


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


def bubble_fraction(num_stages: int, micro_batches: int) -> float:
    """Idle share of a stage under 1F1B with equal stage times: ``(S - 1) / (M + S - 1)``."""
    return (num_stages - 1) / (micro_batches + num_stages - 1)


def simulate(schedules: Sequence[Sequence[Action]], forward: float = 1.0, backward: float = 1.0) -> list[tuple[float, float]]:
    """Replay per-stage schedules with fixed action times; ``(busy, makespan)`` per stage.

    A forward waits for the previous stage's forward of the same micro-batch,
    a backward for the next stage's backward of it; transfers take no time.
    Raises if the schedules deadlock (an action waits on one never run).
    """
    stages = len(schedules)
    done: dict[tuple[int, Phase, int], float] = {}
    clock = [0.0] * stages
    position = [0] * stages
    while any(position[s] < len(schedules[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(schedules[s]):
                action = schedules[s][position[s]]
                ready = _ready_at(done, s, stages, action)
                if ready is None:
                    break
                cost = forward if action.phase is Phase.FORWARD else backward
                clock[s] = max(clock[s], ready) + cost
                done[(s, action.phase, action.micro_batch)] = clock[s]
                position[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: str(schedules[s][position[s]]) for s in range(stages) if position[s] < len(schedules[s])}
            raise RuntimeError(f"the schedules deadlock: stages wait forever at {stuck}")
    makespan = max(clock)
    return [(sum(forward if a.phase is Phase.FORWARD else backward for a in schedules[s]), makespan) for s in range(stages)]


def _ready_at(done: dict[tuple[int, Phase, int], float], stage: int, stages: int, action: Action) -> float | None:
    """When the input of ``action`` is available (None: not yet produced)."""
    if action.phase is Phase.FORWARD:
        source = (stage - 1, Phase.FORWARD, action.micro_batch) if stage > 0 else None
    else:
        source = (stage + 1, Phase.BACKWARD, action.micro_batch) if stage < stages - 1 else (stage, Phase.FORWARD, action.micro_batch)
    if source is None:
        return 0.0
    return done.get(source)
